"""Models by Hugging Face id: `ORG/NAME[@REVISION]` -> a local snapshot folder, through
huggingface_hub.snapshot_download, its cache and its environment (HF_HOME / HF_HUB_CACHE for where,
HF_HUB_OFFLINE=1 for cache only, HF_TOKEN for gated models), as vLLM and SGLang resolve `--model`.

- A path that exists wins: `--model org/name` loads the local folder when there is one.
- Only what jaxinfer reads is fetched (ALLOW_PATTERNS, top-level files: IGNORE_PATTERNS): the
  config, the tokenizer's files, the safetensors and their index, the chat template, the generation
  config, a sentence-transformers model's modules.json and prompts, then its module folders'
  (module_patterns); never *.bin / *.pth pickles, nor the other formats a repository may hold
  (GGUF, ONNX, original/, consolidated.safetensors).
- `ORG/NAME:QUANT` (vLLM's form for GGUF repositories): only the .gguf file(s) of that quantization,
  prepared by jaxinfer.gguf_file.
- Every failure is one error (ModelSpecError) naming the id, the revision and what to do.

Never imports jax (the CLI resolves before the engine starts).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from jaxinfer.cache_dir import cache_dir
from jaxinfer.errors import CheckpointError

# what the loaders read (jaxinfer/weights.py, jaxinfer/tokenizer.py, the chat template, generation
# defaults, a sentence-transformers model's module list and prompts: jaxinfer/embedding.py) ...
ALLOW_PATTERNS = (
    "config.json", "generation_config.json",
    "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer.model", "tiktoken.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
)
# ... at the top level only (huggingface_hub's patterns are fnmatch's, whose * crosses '/': a
# repository's original/ or onnx/ copies would match), and not Mistral's consolidated.safetensors
# (the same weights again, in a layout jaxinfer does not read); a sentence-transformers model's
# module folders (1_Pooling/, ...) are fetched by a second pass (module_patterns)
IGNORE_PATTERNS = ("*/*", "consolidated*.safetensors")
# what a tokenizer alone needs (--tokenizer ORG/NAME): ALLOW_PATTERNS less the weights and the rest
TOKENIZER_PATTERNS = ("config.json", "tokenizer.json", "tokenizer.model", "tiktoken.model", "tokenizer_config.json",
                      "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                      "chat_template.jinja", "chat_template.json")
# a repository id as the Hub writes it: one slash, ORG and NAME of letters, digits, '-', '_', '.'
HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
# a GGUF repository's quantization label after ':' (vLLM's ORG/NAME:QUANT): Q4_K_M, IQ2_XXS, F16, UD-Q4_K_XL
GGUF_QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")


class ModelSpecError(CheckpointError):
    """A --model / from_pretrained path that is neither a local folder nor a usable Hub id (a
    CheckpointError: a model that cannot be loaded, as a missing folder always was)."""


def split_spec(spec: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); 'org/name' -> ('org/name', None)."""
    repo_id, at, revision = spec.partition("@")
    return repo_id, (revision if at else None)


def is_hub_id(spec: str | os.PathLike) -> bool:
    """spec names a Hub repository, or a GGUF quantization in one (ORG/NAME:QUANT), and no local path of
    that name exists."""
    s = os.fspath(spec)
    repo_id, colon, quant = split_spec(s)[0].partition(":")
    return (not Path(s).exists() and HF_ID.fullmatch(repo_id) is not None
            and (not colon or GGUF_QUANT.fullmatch(quant) is not None))


def served_name(spec: str | os.PathLike | None, default: Path) -> str:
    """The model name the server answers to by default: the Hub id (vLLM's), else the folder's name."""
    if spec is not None and is_hub_id(spec):
        return split_spec(os.fspath(spec))[0]
    return Path(spec if spec is not None else default).resolve().name


def resolve_model_path(spec: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder: `spec` itself when it exists (a .gguf file: the folder describing it,
    jaxinfer.gguf_file.prepare_folder), else the snapshot of Hub id `spec` (ORG/NAME, with
    an optional @REVISION; or revision=) in the Hugging Face cache, downloaded there unless
    HF_HUB_OFFLINE=1."""
    s = os.fspath(spec)
    if Path(s).exists():
        if revision is not None:
            raise ModelSpecError(f"{s}: revision={revision!r} applies to Hugging Face ids; this is a local path")
        if Path(s).is_file():
            if not s.endswith(".gguf"):
                raise ModelSpecError(f"{s}: a file; a model is a folder (HF or jaxinfer) or a .gguf file")
            from jaxinfer.gguf_file import prepare_folder
            return prepare_folder(s)
        return Path(s)
    repo_id, at_revision = split_spec(s)
    repo_id, colon, quant = repo_id.partition(":")
    if colon and not GGUF_QUANT.fullmatch(quant):
        raise ModelSpecError(f"{s}: {quant!r} after ':' is not a GGUF quantization label (ORG/NAME:Q4_K_M)")
    if HF_ID.fullmatch(repo_id) is None:
        raise ModelSpecError(f"{s}: no such model folder (nor a Hugging Face model id ORG/NAME[@REVISION])")
    if at_revision is not None and revision is not None and at_revision != revision:
        raise ModelSpecError(f"{s}: two revisions given ({at_revision!r} in the id, revision={revision!r})")
    revision = revision or at_revision
    if revision is not None and not revision:
        raise ModelSpecError(f"{s}: empty revision after '@'")
    if colon:
        return _gguf_download(repo_id, quant, revision)
    return Path(_download(repo_id, revision, model=True))


def resolve_tokenizer_path(spec: str | os.PathLike) -> Path:
    """--tokenizer: a local folder or .gguf file (as resolve_model_path), else Hub id ORG/NAME[@REVISION],
    of which only TOKENIZER_PATTERNS are fetched."""
    s = os.fspath(spec)
    if Path(s).exists():
        return resolve_model_path(s)
    repo_id, revision = split_spec(s)
    if HF_ID.fullmatch(repo_id) is None:
        raise ModelSpecError(f"{s}: no such tokenizer folder (nor a Hugging Face id ORG/NAME[@REVISION])")
    return Path(_download(repo_id, revision, allow=TOKENIZER_PATTERNS, ignore=IGNORE_PATTERNS))


def gguf_files(names: list[str], quant: str) -> list[str]:
    """Of a GGUF repository's files, the model's in quantization `quant` (its label in the file name,
    any case, not followed by more of a longer label: Q4_K is not Q4_K_M; not a vision projector
    mmproj-*): one file, or every part of a split one."""
    label = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return sorted(n for n in names if n.endswith(".gguf") and label.search(Path(n).name)
                  and not Path(n).name.lower().startswith("mmproj"))


def _gguf_download(repo_id: str, quant: str, revision: str | None) -> Path:
    """vLLM's `ORG/NAME:QUANT`: the .gguf file(s) of that quantization in a GGUF repository, as the folder
    jaxinfer.gguf_file prepares for them. The repository's listing is read first and only the chosen
    file (every part of a split one) is fetched; offline, the listing is the cache's snapshot."""
    from huggingface_hub import constants
    from jaxinfer.gguf_file import SPLIT_NAME, prepare_folder
    what = f"{repo_id}:{quant}" + (f" (revision {revision!r})" if revision else "")
    patterns = sorted({f"*{quant}*.gguf", f"*{quant.upper()}*.gguf", f"*{quant.lower()}*.gguf"})
    listing = None if constants.is_offline_mode() else _list_files(repo_id, revision)
    if listing is None:   # offline, or the Hub unreachable: the cache's snapshot is the listing
        root = Path(_download(repo_id, revision, allow=patterns, ignore=()))
        listing = [p.relative_to(root).as_posix() for p in root.rglob("*.gguf")]
    names = gguf_files(listing, quant)
    if not names:
        raise ModelSpecError(f"{what}: the repository has no .gguf file of quantization {quant!r}")
    firsts = [n for n in names if (m := SPLIT_NAME.fullmatch(Path(n).name)) is None or int(m.group(2)) == 1]
    if len(firsts) != 1:
        raise ModelSpecError(f"{what}: {len(firsts)} models match {quant!r} ({', '.join(firsts[:6])}); "
                             "give the file's path")
    m = SPLIT_NAME.fullmatch(Path(firsts[0]).name)
    parts = [firsts[0]] if m is None else [n for n in names if (k := SPLIT_NAME.fullmatch(Path(n).name)) is not None
                                           and Path(n).parent == Path(firsts[0]).parent and k.group(1) == m.group(1)]
    root = Path(_download(repo_id, revision, allow=parts, ignore=()))
    return prepare_folder(root / firsts[0])


def _list_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The repository's files; None when the Hub cannot be reached (snapshot_download then falls back
    to the cache, as it does for every other id)."""
    from huggingface_hub import HfApi
    try:
        return HfApi().list_repo_files(repo_id, revision=revision)
    except Exception as e:   # noqa: BLE001 (httpx's and requests' transport errors alike)
        if _unreachable(e):
            return None
        with _hub_errors(repo_id, revision):   # the Hub's answer (no such repository, gated, ...) named
            raise e


def _unreachable(e: BaseException) -> bool:
    """A transport failure (no connection, a timeout), not an answer of the Hub."""
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        word in type(e).__name__ for word in ("Connect", "Timeout", "Network", "Transport"))


def module_patterns(modules) -> list[str]:
    """The files of a sentence-transformers model's module folders (modules.json's `path`s; the
    root's own are ALLOW_PATTERNS): each folder's config and what the loaders read in it."""
    paths = [m.get("path") for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    return [f"{p.strip('/')}/{pattern}" for p in paths if isinstance(p, str) and p.strip("/")
            for pattern in ALLOW_PATTERNS]


def _download(repo_id: str, revision: str | None, allow=ALLOW_PATTERNS, ignore=IGNORE_PATTERNS,
              model: bool = False) -> str:
    """The snapshot folder of repo_id (allow / ignore: huggingface_hub's patterns). model: a whole model
    is wanted (a GGUF repository without config.json is then refused with the ORG/NAME:QUANT hint)."""
    from huggingface_hub import snapshot_download
    with _hub_errors(repo_id, revision):
        root = snapshot_download(repo_id, revision=revision, allow_patterns=list(allow),
                                 ignore_patterns=list(ignore) or None)
        modules = Path(root) / "modules.json"
        patterns = module_patterns(json.loads(modules.read_text())) if modules.is_file() else []
        if patterns:   # a sentence-transformers model: its modules' folders (Pooling's config, ...)
            root = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
        if model and not (Path(root) / "config.json").exists() and repo_id.lower().endswith("gguf"):
            raise ModelSpecError(f"{repo_id}: a GGUF repository (no config.json); name the quantization to load, "
                                 f"e.g. {repo_id}:Q4_K_M")
        return root


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None):
    """huggingface_hub's failures as one ModelSpecError naming the id, the revision and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    what = f"{repo_id}" + (f" (revision {revision!r})" if revision else "")
    try:
        yield
    except RevisionNotFoundError:
        raise ModelSpecError(f"{repo_id}: revision {revision!r} does not exist on the Hugging Face Hub "
                             "(give a branch, tag or commit of the repository)") from None
    except GatedRepoError:
        raise ModelSpecError(f"{what}: the repository is gated; accept its terms on huggingface.co and set HF_TOKEN "
                             "(or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ModelSpecError(f"{what}: no such repository on the Hugging Face Hub (or it is private: set "
                             "HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:
        where = constants.HF_HUB_CACHE
        if constants.is_offline_mode():
            raise ModelSpecError(
                f"{what}: not in the Hugging Face cache ({where}), and HF_HUB_OFFLINE=1 forbids downloading it; "
                "unset HF_HUB_OFFLINE to download it, or point HF_HOME / HF_HUB_CACHE at a cache that holds "
                "it") from None
        raise ModelSpecError(f"{what}: not in the Hugging Face cache ({where}) and the Hub could not be "
                             f"reached ({e.__cause__ or e})") from None
    except HfHubHTTPError as e:
        raise ModelSpecError(f"{what}: the Hugging Face Hub refused the download ({e})") from None
    except Exception as e:   # noqa: BLE001
        if not _unreachable(e):
            raise
        raise ModelSpecError(f"{what}: the Hugging Face Hub could not be reached ({type(e).__name__}: {e}); "
                             "HF_HUB_OFFLINE=1 uses the cache only") from None


def apply_hf_overrides(folder: Path, overrides: dict) -> Path:
    """A folder that reads as `folder` with its config.json updated by `overrides` (vLLM's
    --hf-overrides: each key set, a nested object merged key by key): the folder's other entries
    linked in, the merged config.json beside them, under the cache (~/.cache/jaxinfer/hf-overrides,
    or $JAXINFER_CACHE/hf-overrides), keyed by the folder and the merged config. A folder without
    config.json (a native checkpoint) is a CheckpointError."""
    import hashlib

    folder = Path(folder).resolve()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: hf_overrides updates a Hugging Face folder's config.json, and this "
                              "folder has none")
    try:
        merged = _merged(json.loads(config_file.read_text()), overrides)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    text = json.dumps(merged, indent=2, sort_keys=True)
    key = hashlib.sha256(f"{folder}\n{text}".encode()).hexdigest()[:20]
    out = cache_dir("hf-overrides") / key
    out.mkdir(parents=True, exist_ok=True)
    for link in out.iterdir():      # entries the folder no longer has
        if link.is_symlink() and not link.exists():
            link.unlink()
    for entry in folder.iterdir():
        link = out / entry.name
        if entry.name != "config.json" and not link.is_symlink():
            try:
                link.symlink_to(entry)
            except FileExistsError:   # another process made it first
                pass
    tmp = out / f".config.json.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, out / "config.json")
    return out


def _merged(config: dict, overrides: dict) -> dict:
    out = dict(config)
    for k, v in overrides.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
