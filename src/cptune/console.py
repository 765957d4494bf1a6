"""What a cptune command prints besides its own messages.

Upstream libraries warn about things a cptune user cannot act on; each one silenced here is named
with the reason, and matched on its exact text so that anything else they say still shows.
Progress bars are drawn only on a terminal: written to a file or a pipe, each redraw becomes a run
of carriage returns and cursor moves (``ESC [A`` from nested bars) instead of a line, so there the
commands print their own plain lines (the Trainer's logged metrics, the data summary) alone.
"""

from __future__ import annotations

import logging
import sys
import warnings

# (message pattern, category) of warnings raised in upstream code that cptune cannot change.
_UPSTREAM_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # ring-flash-attn's collectives and peft's checkpointing query: deprecations of calls they make.
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning),
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
    # accelerate 1.15 slices the flattened mesh dims it made ("dp", "dp_shard_cp") from the root mesh
    # (accelerate/data_loader.py, fsdp_utils.py); torch 2.13 announces that this will change, once per
    # slice, in every FSDP2 run. The user's recipe has no say in it.
    (r"Slicing a flattened dim from root mesh will be deprecated", UserWarning),
)


def quiet_upstream_noise() -> None:
    """Silences the upstream warnings and log lines that are known noise for a cptune run."""
    for pattern, category in _UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    # bitsandbytes 0.50 warns at import, on CPUs with AVX512-BF16, that it cannot fetch a CPU inference
    # kernel from the hub; cptune turns that kernel off (cptune.models.quantization), so the advice to
    # install it is noise.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # The filter stays on the logger when DeepSpeed configures it at import (utils/logging.py).
    logging.getLogger("DeepSpeed").addFilter(_keep_unless_deepspeed_guessed_cpu)


def _keep_unless_deepspeed_guessed_cpu(record: logging.LogRecord) -> bool:
    """Drops DeepSpeed's "Setting accelerator to CPU" where this machine has no CUDA GPU.

    accelerate imports DeepSpeed whenever it is installed (``extract_model_from_parallel``, called by
    the Trainer's constructor), and DeepSpeed's import guesses its accelerator and warns, once per
    process, that it chose the CPU "if you have a GPU ... we were unable to detect it". Without a
    CUDA GPU that choice is right, in runs that do not use DeepSpeed as in those that do; with one,
    the warning would mean something, and it stays.
    """
    if not record.getMessage().startswith("Setting accelerator to CPU"):
        return True
    import torch

    return torch.cuda.is_available()


def progress_bars_on_terminal_only() -> None:
    """Turns the datasets, transformers and hub progress bars off where stderr is not a terminal.

    The Trainer's own bar follows :func:`draws_progress_bars` (``disable_tqdm``).
    """
    if draws_progress_bars():
        return
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def draws_progress_bars() -> bool:
    """Whether progress bars go to a terminal (stderr, where tqdm draws them)."""
    return sys.stderr.isatty()
