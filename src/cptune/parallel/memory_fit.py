"""The activation memory model's fitted coefficients. Generated: do not edit.

Written by ``python -m benchmarks.memory_coefficients fit`` from the traces in
docs/benchmarks/memory_traces.json (2026-11-27; torch 2.13.0+cpu, transformers 5.23.0, peft 0.21.2).
Each layer row is (h, i, kv, token, d): bytes per token per unit of hidden, intermediate and KV
width, per token, and per unit of head_dim (the rotary tables; see cptune.parallel.memory.Widths).
"""

OFFLOAD_ROWS_ON_DEVICE = 2
# Query-width rows per token the CPU attention backward holds beyond the q, k, v gradients
CPU_ATTENTION_BACKWARD_ROWS = 1.0
# (precision, adapter, tiled MLP, recomputed norms) -> {phase: (h, i, kv, token, d)}
LAYERS = {
    ("mixed", "lora", False, False): {
        "forward": (4.0, 8.0, 0.0, 0.0, 4.0),
        "loss": (4.0, 0.0, 0.0, 25.88, 4.0),
        "backward": (14.03, 12.0, 4.0, 200.0, 4.0),
    },
    ("mixed", "lora", True, False): {
        "forward": (11.99, 0.0, 4.0, 14.81, 4.0),
        "loss": (1.98, 0.0, 0.0, 55.5, 4.0),
        "backward": (32.01, 0.0, 4.0, 161.63, 4.0),
    },
    ("mixed", "full", False, False): {
        "forward": (4.0, 6.0, 0.0, 0.0, 4.0),
        "loss": (4.0, 0.0, 0.0, 25.88, 4.0),
        "backward": (18.03, 12.0, 4.0, 8.0, 4.0),
    },
    ("mixed", "lora", True, True): {
        "forward": (11.96, 0.0, 4.0, 59.25, 4.0),
        "loss": (1.94, 0.0, 0.0, 114.75, 4.0),
        "backward": (12.02, 0.0, 4.0, 194.31, 4.0),
    },
    ("mixed", "full", True, False): {
        "forward": (9.99, 0.0, 4.0, 17.28, 4.0),
        "loss": (-0.03, 0.0, 0.0, 60.44, 4.0),
        "backward": (32.0, 0.0, 4.0, 38.56, 4.0),
    },
    ("fp32", "lora", False, False): {
        "forward": (8.0, 16.0, 0.0, 0.0, 8.0),
        "loss": (8.0, 0.0, 0.0, 25.88, 8.0),
        "backward": (20.03, 24.0, 8.0, 392.0, 8.0),
    },
    ("fp32", "lora", True, False): {
        "forward": (23.99, 0.0, 8.0, 16.05, 8.0),
        "loss": (11.98, 0.0, 0.0, 32.09, 8.0),
        "backward": (36.01, 0.0, 8.0, 292.09, 8.0),
    },
    ("fp32", "full", False, False): {
        "forward": (8.0, 12.0, 0.0, 0.0, 8.0),
        "loss": (8.0, 0.0, 0.0, 25.88, 8.0),
        "backward": (28.03, 24.0, 8.0, 8.0, 8.0),
    },
    ("fp32", "full", True, False): {
        "forward": (19.99, 0.0, 8.0, 16.36, 8.0),
        "loss": (7.97, 0.0, 0.0, 32.71, 8.0),
        "backward": (35.99, 0.0, 8.0, 57.07, 8.0),
    },
}
# Without gradient checkpointing, what one layer keeps for its backward:
# (precision, adapter) -> (h, i, kv, token, d)
SAVED = {
    ("mixed", "lora"): (14.03, 8.0, 4.0, 230.0, 0.0),
    ("mixed", "full"): (20.03, 8.0, 4.0, 8.0, 0.0),
    ("fp32", "lora"): (22.03, 16.0, 8.0, 454.0, 0.0),
    ("fp32", "full"): (32.03, 16.0, 8.0, 8.0, 0.0),
}
# The loss from the model's fp32 logits, above the checkpoints: whole or chunked -> (vocab, hidden, token, d)
LOGITS_LOSS = {
    "whole": (12.0, 4.0, 4.0, 4.0),
    "chunked": (8.0, 4.0, 4.0, 4.0),
}
# One chunk in flight, of the head loss or of the loss from logits: (per logit, per hidden unit of its tokens)
CHUNK_BYTES = {
    "head": (12.01, 4.01),
    "logits": (8.01, 0.0),
}
