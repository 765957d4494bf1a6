"""What a cptune command's output must not hold: upstream noise a user cannot act on, bar redraws."""

from __future__ import annotations

import re
import subprocess

NOISE = {
    "Setting accelerator to CPU": "DeepSpeed's accelerator guess (once per rank, DeepSpeed used or not)",
    "'pin_memory' argument is set as true": "torch's note that it cannot pin memory without a GPU",
    "Slicing a flattened dim": "torch's notice about how accelerate slices its mesh (FSDP2)",
    "\x1b[A": "a nested progress bar's cursor move",
    "\r": "a progress bar redrawn in place",
    # Python's text mode reads a lone carriage return as a line end, so a bar shows as its own text too.
    "%|": "a progress bar (tqdm's 'NN%|###|')",
}
PATCHED = re.compile(r"^(?:\[rank \d+\] )?patched \S+ \(([^)]+)\)", flags=re.M)


def noise_in(output: str) -> list[str]:
    """Each kind of noise ``output`` holds, and each patch announced more than once."""
    found = [f"{why}: {text!r}" for text, why in NOISE.items() if text in output]
    announced = PATCHED.findall(output)
    found += [
        f"patch {name} announced {announced.count(name)} times"
        for name in sorted(set(announced))
        if announced.count(name) > 1
    ]
    return found


def assert_quiet(done: subprocess.CompletedProcess) -> None:
    """The command's stdout and stderr (a pipe, not a terminal) hold no noise."""
    found = noise_in(done.stdout + done.stderr)
    assert not found, "\n".join([*found, "--- stderr:", done.stderr[-6000:]])
