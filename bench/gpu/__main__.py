"""`python -m bench.gpu`: bench/gpu/run.py's main."""
import sys

from bench.gpu.run import main

sys.exit(main())
