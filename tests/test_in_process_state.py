"""What a cptune command run in this process (the ``cptune_in_process`` fixture) changes is put back after it."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from tests.conftest import in_process_state, restore_in_process_state


def draws() -> tuple:
    return random.random(), torch.rand(3).tolist(), np.random.rand(3).tolist()


def test_the_random_generators_a_run_seeds_are_put_back():
    """``cptune train`` seeds Python's, torch's and numpy's generators (transformers' set_seed): after it the
    process draws what it would have drawn without the run."""
    from transformers import set_seed

    state = in_process_state()
    expected = draws()
    restore_in_process_state(state)
    set_seed(1234)  # what a run does, and it sets an environment variable
    os.environ["CPTUNE_TEST_LEFT_BEHIND"] = "1"
    restore_in_process_state(state)
    assert in_process_state() == state
    assert "CPTUNE_TEST_LEFT_BEHIND" not in os.environ
    assert draws() == expected
