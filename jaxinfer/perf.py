"""The one cost model: device datasheets and the byte / FLOP / MBU / MFU formulas of a step. The engine's
live stats (jaxinfer/step_stats.py counts each finished step with ModelCost.step_bytes: Engine.stats()
["mbu"], served on /metrics), the benchmarks (bench/metrics.py, bench/gpu/) and `jaxinfer plan` all
read it, so the same run gives the same numbers everywhere.

Pure arithmetic: this module never imports jax, numpy or anything that does (tests check it in a
process where importing jax fails), so the planner answers instantly on any machine.

Formulas (bytes, seconds, FLOPs; L layers, H / H_kv query / KV heads, h head_dim):
    kv_bytes_per_token  = 2 (K and V) * bytes(kv_dtype) * L * H_kv * h  (+ 2 * 4 * L * H_kv for the
                          f32 scale per token per KV head of int8 and fp8 pages)
    bytes_read(step)    = sum over the step's iterations (a multi-step decode runs several on device) of
                            W_read                     every weight read whole, once per iteration: all
                                                       but the gathered tables and the MoE experts
                          + T_i * row                  T_i tokens each gather one row of the untied token
                                                       embedding (and of a learned position table)
                          + L_moe * E_i * expert       E_i experts per MoE layer: the k a lone token
                                                       reaches, else (unknown which) all E
                          + sum_seqs sum_layers min(c, window) * kv_bytes_per_token / L
                                                       each sequence's KV context c after the iteration
                          + S_i * state                each of the S_i sequences' recurrent state, read
                                                       once (conv, Gated DeltaNet and Mamba-2 layers: the
                                                       convolution's last inputs and the float32 matrices)
                          (KV writes of the new tokens are not counted: vLLM/Databricks MBU)
    MBU                 = bytes read / seconds / peak bandwidth
    MFU                 = FLOPs / seconds / peak FLOP/s
    forward_flops(step) = 2 * P_body * T + 2 * V * d * S + sum_layers 4 * H * h * keys(layer)
                          T tokens, S sequences (the LM head runs on one row each), keys = sum over
                          queries of the keys each sees (causal, capped at a sliding window),
                          P_body = parameters a token runs through outside the embedding / LM-head
                          tables (a mixture of experts: its k experts).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1, "int4": 0.5}
KV_INT8_SCALE_BYTES = 4     # one f32 scale per token, per KV head, for K and for V


@dataclass(frozen=True)
class Device:
    """One accelerator's peaks. flops_* are dense (no 2:4 sparsity) tensor-core figures."""
    name: str
    label: str
    memory_bytes: int
    bandwidth: float            # peak memory bandwidth, bytes/s
    flops_bf16: float           # FLOP/s (float16 the same)
    flops_tf32: float           # FLOP/s, for float32 weights (GPU: TF32 tensor cores)
    ops_int8: float             # OP/s; only W8A8 kernels could use it (jaxinfer's are weight-only)
    assumed: tuple[str, ...] = ()   # sentences naming figures that are not datasheet values
    source: str = ""
    slug: str = ""              # its name in bench/results file names when not `name` (one per GPU family)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls computing in `dtype`."""
        return self.flops_tf32 if dtype == "float32" else self.flops_bf16


# Vendor datasheets; the sheets print sparse tensor-core peaks, halved here to dense.
# "80GB" / "141GB" of HBM are binary gigabytes (GiB); nvidia-smi shows slightly less after
# reserved memory, which --memory-fraction absorbs.
DEVICES: dict[str, Device] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 80GB HBM3, 3.35TB/s,
    # BF16 1,979 TFLOPS*, TF32 989 TFLOPS*, INT8 3,958 TOPS* (* with sparsity).
    "h100": Device("h100", "NVIDIA H100 SXM 80GB", 80 * GiB, 3.35e12, 989e12, 494.5e12, 1979e12,
                   source="NVIDIA H100 Tensor Core GPU datasheet (SXM)"),
    # Same datasheet, H100 PCIe column: 80GB HBM2e, 2TB/s, BF16 1,513 TFLOPS*, TF32 756*, INT8 3,026*.
    "h100-pcie": Device("h100-pcie", "NVIDIA H100 PCIe 80GB", 80 * GiB, 2.0e12, 756e12, 378e12, 1513e12,
                        source="NVIDIA H100 Tensor Core GPU datasheet (PCIe)", slug="h100"),
    # Same datasheet, H100 NVL column: 94GB HBM3, 3.9TB/s, BF16 1,671 TFLOPS*, TF32 835*, INT8 3,341*.
    "h100-nvl": Device("h100-nvl", "NVIDIA H100 NVL 94GB", 94 * GiB, 3.9e12, 835.5e12, 417.5e12, 1670.5e12,
                       source="NVIDIA H100 Tensor Core GPU datasheet (NVL)", slug="h100"),
    # NVIDIA GH200 Grace Hopper Superchip datasheet, its H100 GPU: 96GB HBM3 at 4TB/s, or 144GB HBM3e
    # at 4.9TB/s; compute as H100 SXM.
    "gh200": Device("gh200", "NVIDIA GH200 96GB", 96 * GiB, 4.0e12, 989e12, 494.5e12, 1979e12,
                    source="NVIDIA GH200 Grace Hopper Superchip datasheet (HBM3)"),
    "gh200-hbm3e": Device("gh200-hbm3e", "NVIDIA GH200 144GB", 144 * GiB, 4.9e12, 989e12, 494.5e12, 1979e12,
                          source="NVIDIA GH200 Grace Hopper Superchip datasheet (HBM3e)", slug="gh200"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141GB HBM3e, 4.8TB/s, same compute as H100 SXM.
    "h200": Device("h200", "NVIDIA H200 SXM 141GB", 141 * GiB, 4.8e12, 989e12, 494.5e12, 1979e12,
                   source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA A100 Tensor Core GPU datasheet: 40GB HBM2 1,555GB/s; BF16 312 TFLOPS, TF32 156, INT8 624 TOPS.
    "a100-40gb": Device("a100-40gb", "NVIDIA A100 40GB", 40 * GiB, 1.555e12, 312e12, 156e12, 624e12,
                        source="NVIDIA A100 Tensor Core GPU datasheet (40GB SXM)", slug="a100"),
    # Same datasheet, 80GB HBM2e PCIe: 1,935GB/s.
    "a100-80gb-pcie": Device("a100-80gb-pcie", "NVIDIA A100 80GB PCIe", 80 * GiB, 1.935e12, 312e12, 156e12, 624e12,
                             source="NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe)", slug="a100"),
    # Same datasheet, 80GB HBM2e SXM: 2,039GB/s.
    "a100-80gb": Device("a100-80gb", "NVIDIA A100 80GB", 80 * GiB, 2.039e12, 312e12, 156e12, 624e12,
                        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)", slug="a100"),
    # Google Cloud TPU system architecture pages (per chip): HBM, bandwidth, bf16 and int8 peaks;
    # float32 matmuls run through the bf16 MXU passes, so the table reuses the bf16 peak.
    "tpu-v4": Device("tpu-v4", "TPU v4", 32 * GiB, 1.2e12, 275e12, 275e12, 275e12,
                     assumed=("TPU float32 peak taken as the bf16 peak",), source="Cloud TPU v4 documentation"),
    "tpu-v5e": Device("tpu-v5e", "TPU v5e", 16 * GiB, 8.19e11, 197e12, 197e12, 394e12,
                      assumed=("TPU float32 peak taken as the bf16 peak",), source="Cloud TPU v5e documentation"),
    "tpu-v5p": Device("tpu-v5p", "TPU v5p", 95 * GiB, 2.765e12, 459e12, 459e12, 918e12,
                      assumed=("TPU float32 peak taken as the bf16 peak",), source="Cloud TPU v5p documentation"),
    "tpu-v6e": Device("tpu-v6e", "TPU v6e", 32 * GiB, 1.64e12, 918e12, 918e12, 1836e12,
                      assumed=("TPU float32 peak taken as the bf16 peak",), source="Cloud TPU v6e documentation"),
}
# A host CPU: memory from the OS, the rest are round-number assumptions (a few-channel DDR
# server socket, ~1 TFLOP/s of AVX-512 bf16); `plan --memory-gib` overrides the memory.
CPU_BANDWIDTH = 50e9
CPU_FLOPS = 1e12

# jax's device_kind (lower case, "-" as " ") -> DEVICES key; the first pattern whose words all occur wins
_KIND_PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "h100-pcie"), (("h100", "nvl"), "h100-nvl"), (("h100",), "h100"),
    (("gh200", "hbm3e"), "gh200-hbm3e"), (("gh200", "144"), "gh200-hbm3e"), (("gh200",), "gh200"), (("h200",), "h200"),
    (("a100", "40"), "a100-40gb"), (("a100", "pcie"), "a100-80gb-pcie"), (("a100",), "a100-80gb"),
    (("v5 lite",), "tpu-v5e"), (("v5e",), "tpu-v5e"), (("v6",), "tpu-v6e"), (("v5",), "tpu-v5p"), (("v4",), "tpu-v4"),
)


def _datasheet(device_kind: str) -> Device | None:
    kind = device_kind.lower().replace("-", " ")
    for words, key in _KIND_PATTERNS:
        if all(w in kind for w in words):
            return DEVICES[key]
    return None


def device_for_kind(device_kind: str) -> Device | None:
    """The datasheet of jax's device_kind ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB',
    'TPU v5 lite', ...). Unknown kinds (CPUs) have none unless JAXINFER_PEAK_BANDWIDTH (bytes/s)
    and optionally JAXINFER_PEAK_FLOPS are set."""
    sheet = _datasheet(device_kind)
    if sheet is not None:
        return sheet
    bw = os.environ.get("JAXINFER_PEAK_BANDWIDTH")
    if bw:
        flops = float(os.environ.get("JAXINFER_PEAK_FLOPS", 0))
        return Device(device_kind, device_kind, 0, float(bw), flops, flops, 0.0, ("from environment",))
    return None


def host_cpu_device(memory_bytes: int = 0) -> Device:
    """A host CPU under the round-number assumptions CPU_BANDWIDTH and CPU_FLOPS (no datasheet)."""
    return Device("cpu", "host CPU", memory_bytes, CPU_BANDWIDTH, CPU_FLOPS, CPU_FLOPS, CPU_FLOPS,
                  assumed=(f"CPU bandwidth {CPU_BANDWIDTH / 1e9:g} GB/s is an assumption, not a measurement",
                           f"CPU peak {CPU_FLOPS / 1e12:g} TFLOP/s is an assumption, not a measurement"))


def compute_bound_tokens(device: Device, dtype: str, bytes_per_param: float, cfg: Any) -> float:
    """Tokens per step at which a step's matmuls turn compute-bound: the roofline's ridge. B* = F / BW
    FLOPs per byte; T tokens do 2 P T FLOPs over the P b bytes of weights the step reads, 2 T / b
    FLOPs per byte, which reaches B* at T = B* b / 2 (times E / k for a mixture of experts under
    balanced routing: its experts get T k / E rows each). plan.py's compute-bound batch."""
    moe_scale = cfg.num_experts / cfg.num_experts_per_tok if cfg.num_experts else 1
    return device.peak_flops(dtype) / device.bandwidth * bytes_per_param / 2 * moe_scale


def with_memory(device: Device, memory_bytes: int, why: str) -> Device:
    return dataclasses.replace(device, memory_bytes=memory_bytes, assumed=(why,))


def device_slug(device_kind: str, platform: str) -> str:
    """The device's name in bench/results file names: "cpu", the datasheet's family ("h100", "a100",
    "tpu-v5e", ...), else jax's device_kind in lower case with runs of other characters as "-"."""
    if platform == "cpu":
        return "cpu"
    sheet = _datasheet(device_kind)
    if sheet is not None:
        return sheet.slug or sheet.name
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or platform


def table_peaks(device_kind: str, dtype: str = "bfloat16") -> dict[str, Any] | None:
    """The datasheet peaks of jax's device_kind for MBU / MFU (bench results' "peaks"), or None."""
    dev = device_for_kind(device_kind)
    if dev is None or not dev.flops_bf16:
        return None
    return {"name": dev.label, "bandwidth_Bps": dev.bandwidth, "flops": dev.peak_flops(dtype),
            "flops_dtype": dtype, "source": "table"}


# --------------------------------------------------------------------------- bytes
def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: str,
                       value_dim: int | None = None) -> int:
    """K and V of one token in `n_layers` layers of `n_kv_heads` heads (+ int8/fp8 pages' f32 scales).
    value_dim: the V pages' width when not head_dim (0: no V pages, latent attention's values read
    from the K pages: ModelConfig.kv_value_dim)."""
    if kv_dtype not in DTYPE_BYTES or kv_dtype == "int4":
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose from: float32, bfloat16, float16, int8, fp8")
    value_dim = head_dim if value_dim is None else value_dim
    total = int(DTYPE_BYTES[kv_dtype]) * n_layers * n_kv_heads * (head_dim + value_dim)
    if kv_dtype in ("int8", "fp8"):
        total += (1 + (value_dim > 0)) * KV_INT8_SCALE_BYTES * n_layers * n_kv_heads
    return total


def bytes_read(weight_bytes: float, kv_bytes_per_token: float, context_tokens: float, iterations: int = 1) -> float:
    """Bytes one step reads: every weight once per iteration, plus the KV of every context token
    attended (summed over sequences and iterations)."""
    return iterations * weight_bytes + context_tokens * kv_bytes_per_token


def mbu(bytes_per_s: float | None, peak_bandwidth: float | None) -> float | None:
    """Model bandwidth utilisation: achieved bytes/s over the peak (None when either is unknown)."""
    return bytes_per_s / peak_bandwidth if bytes_per_s is not None and peak_bandwidth else None


def mfu(flops_per_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOP/s utilisation: achieved FLOP/s over the peak (None when either is unknown)."""
    return flops_per_s / peak_flops if flops_per_s is not None and peak_flops else None


# --------------------------------------------------------------------------- FLOPs
def attention_keys(start: int, num_tokens: int, window: int | None) -> int:
    """Keys seen by queries start .. start + num_tokens - 1 (query i sees i + 1 keys, causal),
    each capped at the sliding window."""
    if window is None:      # sum of start + 1 .. start + n
        return num_tokens * start + num_tokens * (num_tokens + 1) // 2
    return sum(min(k, window) for k in range(start + 1, start + num_tokens + 1))


def forward_flops(body_params: int, vocab_size: int, d_model: int, n_heads: int, head_dim: int,
                  spans: Sequence[tuple[int, int]], windows: Sequence[int | None]) -> float:
    """FLOPs of one forward over sequences computing spans [(start, num_tokens)]; `windows` has one
    entry per layer (None = full causal). 2 FLOPs per multiply-add; 4 = 2 x (QK^T + PV)."""
    tokens = sum(n for _, n in spans)
    linear = 2.0 * body_params * tokens + 2.0 * vocab_size * d_model * len(spans)
    attn = sum(4.0 * n_heads * head_dim * sum(attention_keys(s, n, w) for s, n in spans) for w in windows)
    return linear + attn


# --------------------------------------------------------------------------- the cost of a step
_KV_DTYPE_OF_ITEMSIZE = {4: "float32", 2: "bfloat16", 1: "int8"}


@dataclass
class StepRecord:
    """One step for the MBU / MFU aggregates: its seconds and, per scheduled sequence, (start,
    num_tokens) and, when known, how many iterations the device ran it (multi-step decode)."""
    time_s: float
    spans: list[tuple[int, int]]
    execute_s: float | None = None     # the engine's own device time of the step, for reference
    iterations: list[int] | None = None

    def iteration_spans(self) -> list[list[tuple[int, int]]]:
        """The (start, num_tokens) of the sequences each device iteration ran: a sequence run several
        iterations (multi-step decode) is live in each, one token further along each time."""
        its = self.iterations if self.iterations is not None else [1] * self.num_seqs
        return [[(s + j, n) for (s, n), k in zip(self.spans, its) if k > j] for j in range(max(its, default=0))]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.spans)

    @property
    def num_seqs(self) -> int:
        return len(self.spans)

    @property
    def context_lens(self) -> list[int]:
        return [s + n for s, n in self.spans]

    @property
    def is_decode(self) -> bool:
        return bool(self.spans) and all(n == 1 for _, n in self.spans)


@dataclass(frozen=True)
class WeightBytes:
    """A model's weight bytes as stored (quantized: codes, scales, zero points), split by how a step
    reads them: from the loaded parameters (models.decoder.weight_bytes, the engine) or from the
    shapes and a storage dtype (jaxinfer.plan)."""
    total: int
    tables: int = 0         # the untied token embedding and a learned position table: gathered, not read
    row: int = 0            # what one token gathers from those tables
    experts: int = 0        # every expert of every MoE layer

    @classmethod
    def of_float(cls, cfg: Any, itemsize: float) -> "WeightBytes":
        """Every parameter stored in one float dtype of `itemsize` bytes (ModelConfig.param_counts)."""
        c = cfg.param_counts()
        untied = 1 if c["lm_head"] else 0
        rows = untied + (1 if c["positions"] else 0)
        return cls(round(c["total"] * itemsize), round((untied * c["embedding"] + c["positions"]) * itemsize),
                   round(rows * cfg.d_model * itemsize), round(c["experts"] * itemsize))


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model reads and computes (the module docstring's formulas)."""
    n_layers: int
    n_heads: int
    head_dim: int
    d_model: int
    vocab_size: int
    body_params: int                      # FLOPs: parameters a token runs through outside the embedding tables
    weight_bytes_read: int                # W_read: read whole once per iteration
    kv_bytes_per_token: int               # K and V of one token, all layers
    windows: tuple[int | None, ...] = ()  # per layer sliding window (None = full causal; 0: a layer without KV)
    row_bytes: int = 0                    # gathered per token from the token (and position) tables
    expert_bytes: int = 0                 # one expert of one MoE layer
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    state_bytes_per_sequence: int = 0     # a sequence's state over its state layers (ModelConfig.state_bytes_per_slot)

    @classmethod
    def build(cls, cfg: Any, weights: WeightBytes, kv_bytes_per_token: int,
              state_bytes_per_sequence: int = 0) -> "ModelCost":
        """From a ModelConfig, its weight bytes, its KV bytes per token and a sequence's state bytes
        (ModelConfig.state_bytes_per_slot in the dtype the states are kept in; 0 without state layers)."""
        c = cfg.param_counts()
        body = cfg.num_active_params() - c["embedding"] - c["lm_head"] - c["positions"]
        experts = c["moe_layers"] * cfg.num_experts
        return cls(cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.d_model, cfg.vocab_size, body,
                   weights.total - weights.tables - weights.experts, kv_bytes_per_token,
                   tuple(0 if not cfg.has_kv(i) else cfg.layer_window(i) for i in range(cfg.n_layers)), weights.row,
                   weights.experts // experts if experts else 0, c["moe_layers"],
                   cfg.num_experts if experts else 0, cfg.num_experts_per_tok if experts else 0,
                   state_bytes_per_sequence)

    @classmethod
    def from_config(cls, cfg: Any, weight_itemsize: float, kv_itemsize: int) -> "ModelCost":
        """Float weights of `weight_itemsize` bytes and float (or int8) KV pages of `kv_itemsize`."""
        kv = kv_bytes_per_token(cfg.n_attn_layers, cfg.n_kv_heads, cfg.head_dim, _KV_DTYPE_OF_ITEMSIZE[kv_itemsize],
                                getattr(cfg, "kv_value_dim", None))
        return cls.build(cfg, WeightBytes.of_float(cfg, weight_itemsize), kv,
                         cfg.state_bytes_per_slot(4 if weight_itemsize == 4 else 2))

    @classmethod
    def from_stats(cls, cfg: Any, stats: dict) -> "ModelCost":
        """From the model's config and the engine's stats(): the engine's own weight bytes and KV bytes."""
        weights = WeightBytes(stats["weight_bytes"], stats["embedding_table_bytes"], stats["embedding_row_bytes"],
                              stats["expert_weight_bytes"])
        return cls.build(cfg, weights, stats["kv_bytes_per_token"], stats.get("state_bytes_per_sequence", 0))

    @property
    def attn_layers(self) -> int:
        """The layers with KV (a conv layer's window is 0: it reads none)."""
        return max(1, sum(w != 0 for w in self._layer_windows()))

    def _layer_windows(self) -> list[int | None]:
        return list(self.windows) if self.windows else [None] * self.n_layers

    def experts_read(self, tokens: int) -> int:
        """Experts of one MoE layer that `tokens` tokens reach, at most: each token its k, all of
        them once tokens * k >= E (which ones is not known here)."""
        return min(self.num_experts, tokens * self.experts_per_token)

    def step_bytes(self, step: StepRecord) -> float:
        """Bytes one step reads, summed over its iterations (step.iteration_spans)."""
        return sum(bytes_read(self.iteration_weight_bytes(sum(n for _, n in live)),
                              self.kv_bytes_per_token / self.attn_layers, self.layer_context([s + n for s, n in live]))
                   + len(live) * self.state_bytes_per_sequence for live in step.iteration_spans())

    def iteration_weight_bytes(self, tokens: int) -> int:
        """Weight bytes one iteration over `tokens` tokens reads: W_read, a row per token, the experts reached."""
        return (self.weight_bytes_read + tokens * self.row_bytes
                + self.moe_layers * self.experts_read(tokens) * self.expert_bytes)

    def layer_context(self, context_lens: Sequence[int]) -> int:
        """Tokens of KV, summed over layers, that attention reads for sequences of these contexts (each
        layer up to its sliding window): times kv_bytes_per_token / n_layers, the KV bytes read."""
        return sum(c if w is None else min(c, w) for w in self._layer_windows() for c in context_lens)

    def step_flops(self, step: StepRecord) -> float:
        """FLOPs of the step's forwards, one per iteration (step.iteration_spans)."""
        return sum(forward_flops(self.body_params, self.vocab_size, self.d_model, self.n_heads, self.head_dim,
                                 live, self._layer_windows())
                   for live in step.iteration_spans())


def utilization(steps: Sequence[StepRecord], cost: ModelCost, peak_bandwidth: float | None,
                peak_flops: float | None) -> dict[str, Any]:
    """MBU / MFU over all steps and over pure-decode steps: sum of bytes (FLOPs) over sum of seconds,
    over the peak (the aggregate achieved rate, time-weighted over steps)."""
    def agg(sel: list[StepRecord], suffix: str) -> dict[str, Any]:
        t = sum(s.time_s for s in sel)
        b = sum(cost.step_bytes(s) for s in sel)
        f = sum(cost.step_flops(s) for s in sel)
        bw = b / t if t > 0 else None
        fl = f / t if t > 0 else None
        return {
            f"num_steps{suffix}": len(sel), f"step_time_s{suffix}": t, f"bytes_read{suffix}": b,
            f"achieved_bandwidth_Bps{suffix}": bw, f"achieved_flops{suffix}": fl,
            f"mbu{suffix}": mbu(bw, peak_bandwidth), f"mfu{suffix}": mfu(fl, peak_flops),
        }
    out = agg(list(steps), "") | agg([s for s in steps if s.is_decode], "_decode")
    return out | {"weight_bytes_read": cost.weight_bytes_read, "kv_bytes_per_token": cost.kv_bytes_per_token}


# --------------------------------------------------------------------------- the KV pool
# JAX's GPU client caps its allocator at this fraction of the device's memory unless
# XLA_CLIENT_MEM_FRACTION (or the older XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise.
XLA_DEFAULT_MEM_FRACTION = 0.75
HOST_POOL_SHARE = 4          # on CPU the pool takes at most a quarter of the host's RAM
ACTIVATION_SLACK = 256 << 20   # workspace beyond the step's activations (cuBLAS / cuDNN / Triton)


@dataclass(frozen=True)
class PoolSize:
    """How the KV pool was sized (Engine: num_blocks=None). Device memory is what the engine may
    use: memory_fraction of the device's memory (capped by what JAX's allocator may hand out) less
    what is already allocated (the loaded weights, other engines' pools) and the step's activations.
    On a host CPU: what max_num_seqs sequences of max_model_len need, capped at a share of RAM."""
    num_blocks: int              # the null block 0 included
    block_bytes: int             # one block of every layer's K and V (and a draft model's)
    on_device: bool
    device_bytes: int = 0        # the device's memory (0 on a host CPU: host RAM instead)
    memory_fraction: float = 0.0
    allocator_limit: int = 0     # what JAX's allocator may hand out in all
    in_use: int = 0              # already allocated when the pool was sized (weights included)
    reserve: int = 0             # the largest step's activations and workspace
    host_ram: int = 0

    @property
    def budget(self) -> int:
        """Bytes the engine may hold in all: min(fraction x device memory, allocator's limit)."""
        return min(int(self.memory_fraction * self.device_bytes), self.allocator_limit)

    @property
    def allocator_bound(self) -> bool:
        """JAX's allocator limit, not memory_fraction, bounds the pool (XLA_CLIENT_MEM_FRACTION)."""
        return self.on_device and self.allocator_limit < int(self.memory_fraction * self.device_bytes)

    def describe(self) -> str:
        if not self.on_device:
            return f"{self.num_blocks - 1} blocks on the host ({self.host_ram / GiB:.1f} GiB of RAM / {HOST_POOL_SHARE} at most)"
        limit = (f", capped by JAX's allocator limit {self.allocator_limit / GiB:.2f} GiB (XLA_CLIENT_MEM_FRACTION)"
                 if self.allocator_bound else "")
        return (f"memory_fraction {self.memory_fraction:g} of {self.device_bytes / GiB:.2f} GiB = "
                f"{self.memory_fraction * self.device_bytes / GiB:.2f} GiB{limit}, less {self.in_use / GiB:.2f} GiB "
                f"already in use (weights included) and {self.reserve / GiB:.2f} GiB for the step's activations, "
                f"leaves {self.num_blocks * self.block_bytes / GiB:.2f} GiB for the KV pool")


def xla_mem_fraction(env: dict[str, str]) -> float:
    """The fraction of the device's memory JAX's GPU allocator was given (its env variables)."""
    value = env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return float(value) if value else XLA_DEFAULT_MEM_FRACTION


def device_memory(stats: dict, platform: str, env: dict[str, str]) -> int:
    """The device's memory from its allocator's stats: a GPU's BFC allocator is sized at
    xla_mem_fraction of the device (JAX's documented default, 75%), a TPU's limit is its HBM."""
    limit = int(stats["bytes_limit"])
    allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
    if platform == "gpu" and allocator in ("default", "bfc"):
        return int(limit / xla_mem_fraction(env))
    return limit


def step_activation_bytes(*, tokens: int, rows: int, d_model: int, ffn_dim: int, n_heads: int,
                          head_dim: int, vocab_size: int, dtype_bytes: int) -> int:
    """An upper estimate of the largest step's live temporaries: the logits of `rows` sequences in
    float32 with the sampler's and the log-probabilities' copies (8 of them: XLA's buffer assignment
    of the 512-token, 256-row step holds ~7 at once at a 128,256-token vocabulary; 4 were counted
    before, and an H200 run's allocator peak stood 1.68 GB above memory in use against that 0.91 GB
    reserve), and per token the residual stream and norms in float32, q/k/v and the gated MLP's two
    halves in the model dtype (x2: input and output of each matmul live together), plus
    ACTIVATION_SLACK. tests/test_cost_model.py checks it against XLA's memory analysis."""
    logits = 8 * rows * vocab_size * 4
    per_token = 4 * d_model * 4 + 2 * dtype_bytes * (3 * n_heads * head_dim + 2 * ffn_dim)
    return logits + tokens * per_token + ACTIVATION_SLACK


def size_kv_pool(*, block_bytes: int, memory_fraction: float, stats: dict | None, platform: str,
                 env: dict[str, str], reserve: int, host_ram: int, wanted_blocks: int) -> PoolSize:
    """The KV pool for num_blocks=None. stats: the device's memory_stats() (None on a host CPU);
    wanted_blocks: what max_num_seqs sequences of max_model_len need (+ the null block), the most a
    host pool takes. Never fewer than 2 blocks: resolve_config refuses a pool too small for one
    sequence, naming the numbers (PoolSize.describe)."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if not stats or "bytes_limit" not in stats:
        blocks = min(wanted_blocks, host_ram // HOST_POOL_SHARE // block_bytes)
        return PoolSize(max(2, int(blocks)), block_bytes, False, host_ram=host_ram)
    pool = PoolSize(0, block_bytes, True, device_memory(stats, platform, env), memory_fraction,
                    int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)), reserve)
    free = pool.budget - pool.in_use - reserve
    return dataclasses.replace(pool, num_blocks=max(2, int(free // block_bytes)))
