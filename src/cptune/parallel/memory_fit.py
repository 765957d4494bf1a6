"""The activation memory model's fitted coefficients. Generated: do not edit.

Written by ``python -m benchmarks.memory_coefficients fit`` from the traces in
docs/benchmarks/memory_traces.json (2026-11-26; torch 2.13.0+cpu, transformers 5.23.0, peft 0.21.2).
Each layer row is (h, i, kv, token): bytes per token per unit of hidden, intermediate and KV
width, and per token (see cptune.parallel.memory.Widths).
"""

OFFLOAD_ROWS_ON_DEVICE = 2
# Query-width rows per token the CPU attention backward holds beyond the q, k, v gradients
CPU_ATTENTION_BACKWARD_ROWS = 1.0
# (precision, adapter, tiled MLP, recomputed norms) -> {phase: (h, i, kv, token)}
LAYERS = {
    ("mixed", "lora", False, False): {
        "forward": (4.0, 8.0, 0.0, 512.0),
        "loss": (4.0, 0.0, 0.0, 537.88),
        "backward": (14.03, 12.0, 4.0, 712.0),
    },
    ("mixed", "lora", True, False): {
        "forward": (11.99, 0.0, 4.0, 526.81),
        "loss": (1.98, 0.0, 0.0, 567.5),
        "backward": (32.01, 0.0, 4.0, 673.63),
    },
    ("mixed", "full", False, False): {
        "forward": (4.0, 6.0, 0.0, 512.0),
        "loss": (4.0, 0.0, 0.0, 537.88),
        "backward": (18.03, 12.0, 4.0, 520.0),
    },
    ("mixed", "lora", True, True): {
        "forward": (11.96, 0.0, 4.0, 571.25),
        "loss": (1.94, 0.0, 0.0, 626.75),
        "backward": (12.02, 0.0, 4.0, 706.31),
    },
}
