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
    ("mixed", "full", True, False): {
        "forward": (9.99, 0.0, 4.0, 529.28),
        "loss": (-0.03, 0.0, 0.0, 572.44),
        "backward": (32.0, 0.0, 4.0, 550.56),
    },
    ("fp32", "lora", False, False): {
        "forward": (8.0, 16.0, 0.0, 1024.0),
        "loss": (8.0, 0.0, 0.0, 1049.88),
        "backward": (20.03, 24.0, 8.0, 1416.0),
    },
    ("fp32", "full", False, False): {
        "forward": (8.0, 12.0, 0.0, 1024.0),
        "loss": (8.0, 0.0, 0.0, 1049.88),
        "backward": (28.03, 24.0, 8.0, 1032.0),
    },
}
# Without gradient checkpointing, what one layer keeps for its backward:
# (precision, adapter) -> (h, i, kv, token)
SAVED = {
    ("mixed", "lora"): (14.03, 8.0, 4.0, 230.0),
    ("mixed", "full"): (20.03, 8.0, 4.0, 8.0),
    ("fp32", "lora"): (22.03, 16.0, 8.0, 454.0),
    ("fp32", "full"): (32.03, 16.0, 8.0, 8.0),
}
# The loss from the model's fp32 logits, above the checkpoints: whole or chunked -> (vocab, hidden, token)
LOGITS_LOSS = {
    "whole": (12.0, 4.0, 516.0),
    "chunked": (8.0, 4.0, 516.0),
}
# One chunk in flight, of the head loss or of the loss from logits: (per logit, per hidden unit of its tokens)
CHUNK_BYTES = {
    "head": (12.01, 4.01),
    "logits": (8.01, 0.0),
}
