"""`python -m minivllm ...`: the `minivllm` command (what `torchrun -m minivllm serve ...` starts on each rank)."""

from minivllm.cli import main

raise SystemExit(main())
