"""cptune's own launcher: a rank that dies stops the whole run quickly, naming the rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cptune.run.launch.processes import LaunchPlan, child_environment

# The launcher waits GRACE_SECONDS (10 s) for the other ranks, then SIGTERM, then
# SIGKILL after another 10 s (20 s at worst): a run must be over well within this bound.
EXIT_BOUND_SECONDS = 40


def children_by_rank(parent: int) -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def test_child_environment_is_torchrun_like():
    env = child_environment(LaunchPlan(nproc_per_node=2), rank=1, port=1234, base={"PATH": "/bin"})
    assert env["RANK"] == env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_PORT"] == "1234" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"


# How each rank behaves in the launcher tests below (stand-ins for `python -m cptune`): rank 1
# fails at once; rank 0 then exits on its own (as after a broken collective), stops on SIGTERM,
# or ignores SIGTERM (as a process stuck in native code may).
FAILING_RANK = "import time; time.sleep(0.3); raise SystemExit(3)"
SURVIVORS = {
    "exits-itself": (
        "import time; time.sleep(1.2); raise SystemExit(1)",
        "stopped the other ranks: rank 0 exited with code 1.",
    ),
    "stops-on-sigterm": (
        "import time; time.sleep(60)",
        "stopped the other ranks: rank 0 did not exit on its own and was sent SIGTERM (code -15).",
    ),
    "ignores-sigterm": (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        "stopped the other ranks: rank 0 did not exit on its own and was sent SIGKILL (code -9).",
    ),
}


@pytest.mark.distributed  # the launcher and its rank processes
@pytest.mark.parametrize("survivor", sorted(SURVIVORS))
def test_launcher_stops_every_rank_and_says_how_each_ended(survivor, monkeypatch, capsys):
    from cptune.run.launch import processes as launch_module

    script, expected = SURVIVORS[survivor]
    real_popen = subprocess.Popen
    started = []

    def fake_popen(command, env):
        assert command[1:4] == ["-m", "cptune", "train"]
        code = FAILING_RANK if env["RANK"] == "1" else script
        started.append(real_popen([sys.executable, "-c", code], env=env))
        return started[-1]

    monkeypatch.setattr(launch_module.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(launch_module, "GRACE_SECONDS", 2.0)
    began = time.monotonic()
    code = launch_module.launch(LaunchPlan(nproc_per_node=2), ["train", "recipe.yaml"])
    took = time.monotonic() - began
    stderr = capsys.readouterr().err
    assert code == 3
    assert f"cptune: rank 1 exited with code 3; {expected}" in stderr, stderr
    assert all(p.returncode is not None for p in started)
    assert took < 10, took  # 0.3 s until rank 1 fails, then at most 2 s grace + 2 s after SIGTERM


def _sigterm_when_started(started: list, count: int) -> threading.Thread:
    """SIGTERM to this process (the launcher under test) once ``count`` stand-in processes run."""

    def send() -> None:
        deadline = time.monotonic() + 30
        while len(started) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the stand-ins are running Python by now
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _launch_with_harmless_sigterm(launch_module, plan: LaunchPlan, started: list, count: int) -> int:
    """Launch, sending SIGTERM to this process meanwhile; a launcher that ignored it must not end pytest.

    Without the launcher's own handler the signal reaches this no-op one instead, and the launch
    returns only when the stand-ins end by themselves (code 0, and no "sent SIGTERM" line).
    """
    original = signal.getsignal(signal.SIGTERM)

    def harmless(signum, frame):
        pass

    signal.signal(signal.SIGTERM, harmless)
    try:
        sender = _sigterm_when_started(started, count)
        code = launch_module.launch(plan, ["train", "recipe.yaml"])
        sender.join()
        assert signal.getsignal(signal.SIGTERM) is harmless  # the launcher put back the handler it found
    finally:
        signal.signal(signal.SIGTERM, original)
    return code


@pytest.mark.distributed  # the launcher and its rank processes
@pytest.mark.parametrize(
    ("rank1", "expected"),
    [
        ("import time; time.sleep(20)", "rank 1 was sent SIGTERM (code -15)"),
        (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(20)",
            "rank 1 was sent SIGKILL (code -9)",
        ),
    ],
    ids=["stops-on-sigterm", "ignores-sigterm"],
)
def test_sigterm_to_the_launcher_stops_every_rank(rank1, expected, monkeypatch, capsys):
    """`kill` or a scheduler's SIGTERM to the launcher leaves no rank running (none orphaned)."""
    from cptune.run.launch import processes as launch_module

    real_popen = subprocess.Popen
    started = []

    def fake_popen(command, env):
        code = rank1 if env["RANK"] == "1" else "import time; time.sleep(20)"
        started.append(real_popen([sys.executable, "-c", code], env=env))
        return started[-1]

    monkeypatch.setattr(launch_module.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(launch_module, "GRACE_SECONDS", 2.0)
    code = _launch_with_harmless_sigterm(launch_module, LaunchPlan(nproc_per_node=2), started, 2)
    stderr = capsys.readouterr().err
    assert code == 143
    assert all(p.returncode is not None for p in started)
    assert (
        "cptune: the launcher was sent SIGTERM; stopped every rank: "
        f"rank 0 was sent SIGTERM (code -15); {expected}." in stderr
    ), stderr


@pytest.mark.distributed  # the launcher starts (a stand-in for) torchrun
def test_sigterm_to_the_launcher_reaches_torchrun(monkeypatch):
    """Multi-node: the launcher passes SIGTERM on to torchrun (which stops its own workers)."""
    from cptune.run.launch import processes as launch_module

    real_popen = subprocess.Popen
    started = []

    def fake_popen(command):
        assert command[1:3] == ["-m", "torch.distributed.run"]
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(20)"]))
        return started[-1]

    monkeypatch.setattr(launch_module.subprocess, "Popen", fake_popen)
    plan = LaunchPlan(nproc_per_node=2, nnodes=2, rdzv_endpoint="head:29500", rdzv_backend="c10d")
    code = _launch_with_harmless_sigterm(launch_module, plan, started, 1)
    assert code == 143 and started[0].returncode == -signal.SIGTERM


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the rank processes")
def test_killed_rank_stops_the_run_within_bound(write_recipe, tmp_path):
    """SIGKILL rank 1 mid-training: rank 0 and the launcher exit non-zero within EXIT_BOUND_SECONDS."""
    recipe = write_recipe(max_steps=100000, context_parallel_size=2, logging_steps=1)
    stderr_path, stdout_path = tmp_path / "stderr.txt", tmp_path / "stdout.txt"
    with stderr_path.open("w") as stderr_file, stdout_path.open("w") as stdout_file:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "cptune", "train", str(recipe)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=stdout_file,
            stderr=stderr_file,
        )
        try:
            # Wait until training runs: rank 0 has logged a step.
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and "'loss'" not in stdout_path.read_text():
                assert launcher.poll() is None, stderr_path.read_text()[-2000:]
                time.sleep(0.5)
            ranks = children_by_rank(launcher.pid)
            assert len(ranks) == 2, f"ranks not found: {ranks}"
            killed_at = time.monotonic()
            os.kill(ranks[1], signal.SIGKILL)
            launcher.wait(timeout=EXIT_BOUND_SECONDS + 20)
            took = time.monotonic() - killed_at
        finally:
            if launcher.poll() is None:
                launcher.kill()
    stderr = stderr_path.read_text()
    print(f"the run was over {took:.1f} s after rank 1 was killed (bound {EXIT_BOUND_SECONDS} s)")
    assert launcher.returncode != 0
    assert took <= EXIT_BOUND_SECONDS, took
    # The launcher names the killed rank and says how the surviving rank ended: non-zero.
    verdict = re.search(
        r"^cptune: rank 1 exited with code -9 \(SIGKILL\); stopped the other ranks: (.*)$", stderr, re.M
    )
    assert verdict, stderr[-3000:]
    survivor = re.search(
        r"rank 0 (?:exited with |did not exit on its own and was sent \w+ \()code (-?\d+)", verdict[1]
    )
    assert survivor and int(survivor[1]) != 0, verdict[0]
    # The surviving rank is gone (not left running, orphaned, once the launcher exited).
    assert not Path(f"/proc/{ranks[0]}").exists()


# Started by Python in every process whose PYTHONPATH holds it: at its third training step rank 1
# raises (CPTUNE_TEST_FAILURE=raise) or stops answering (=hang).
FAILING_RANK_HOOK = """
import os
if os.environ.get("RANK") == "1":
    import time
    from pathlib import Path

    from cptune.run.training.trainer import CptuneTrainer

    original = CptuneTrainer.training_step
    calls = []

    def training_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            Path(os.environ["CPTUNE_TEST_FAILED_AT"]).write_text(repr(time.time()))
            if os.environ["CPTUNE_TEST_FAILURE"] == "hang":
                time.sleep(3600)
            raise RuntimeError("simulated failure on rank 1")
        return original(self, *args, **kwargs)

    CptuneTrainer.training_step = training_step
"""


def run_with_raising_rank(
    command: list[str], recipe: Path, tmp_path: Path, failure: str = "raise"
) -> tuple[int, str, float]:
    """Run ``command`` (a launcher) with rank 1 failing mid-training; (exit code, stderr, seconds to exit)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAILING_RANK_HOOK)
    failed_at = tmp_path / "failed_at"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "CPTUNE_TEST_FAILED_AT": str(failed_at),
        "CPTUNE_TEST_FAILURE": failure,
    }
    done = subprocess.run(
        [*command, "train", str(recipe)], env=env, capture_output=True, text=True, timeout=300
    )
    ended = time.time()
    assert failed_at.exists(), f"rank 1 never reached its third step:\n{done.stderr[-3000:]}"
    return done.returncode, done.stderr, ended - float(failed_at.read_text())


@pytest.mark.distributed
def test_raising_rank_stops_the_run_within_bound(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=100000, context_parallel_size=2)
    code, stderr, took = run_with_raising_rank([sys.executable, "-m", "cptune"], recipe, tmp_path)
    assert code != 0
    assert "RuntimeError: simulated failure on rank 1" in stderr
    assert "cptune: rank 1 exited with code 1; stopped the other ranks: rank 0 " in stderr
    print(f"the run was over {took:.1f} s after rank 1 raised (bound {EXIT_BOUND_SECONDS} s)")
    assert took <= EXIT_BOUND_SECONDS, took
    assert not (tmp_path / "out" / "train_log.json").exists()


@pytest.mark.distributed
def test_hung_rank_stops_the_run_after_ddp_timeout_on_cpu(write_recipe, tmp_path):
    """Rank 1 stops answering: rank 0's collective fails after ddp_timeout, naming it, and the run ends."""
    recipe = write_recipe(max_steps=100000, context_parallel_size=2, ddp_timeout=10)
    code, stderr, took = run_with_raising_rank(
        [sys.executable, "-m", "cptune"], recipe, tmp_path, failure="hang"
    )
    print(f"the run was over {took:.1f} s after rank 1 hung (ddp_timeout 10 s, bound {EXIT_BOUND_SECONDS} s)")
    assert code != 0
    assert re.search(
        r"\[rank 0\] error: a collective \(\w+\) waited longer than ddp_timeout \(10 s\)", stderr, re.M
    ), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (
        "cptune: rank 0 exited with code 1; stopped the other ranks: "
        "rank 1 did not exit on its own and was sent SIGTERM (code -15)." in stderr
    ), stderr[-3000:]
    # torch's default timeout (1800 s) would hold the run for half an hour.
    assert took <= EXIT_BOUND_SECONDS, took


def test_default_processes_one_per_gpu():
    """On a GPU node `cptune train` starts a process per visible GPU (dp = GPUs / cp); on CPU the recipe's layout."""
    from cptune.config.loader import validate_recipe
    from cptune.errors import LaunchError
    from cptune.run.launch.processes import default_nproc_per_node

    def recipe(**keys):
        return validate_recipe({"base_model": "m", "datasets": [{"path": "d.jsonl"}], **keys})

    cp4 = recipe(context_parallel_size=4)
    assert default_nproc_per_node(cp4, gpu_count=0) == 4  # CPU: unchanged
    assert default_nproc_per_node(cp4, gpu_count=8) == 8  # 2 data-parallel groups of 4
    assert default_nproc_per_node(recipe(), gpu_count=8) == 8
    hsdp = recipe(context_parallel_size=2, fsdp_version=2, dp_replicate_size=2)
    assert default_nproc_per_node(hsdp, gpu_count=8) == 8
    fixed = recipe(context_parallel_size=2, fsdp_version=2, dp_shard_size=2)
    assert default_nproc_per_node(fixed, gpu_count=8) == 4  # the layout the recipe fixes
    tp = recipe(context_parallel_size=2, fsdp_version=2, tensor_parallel_size=2)
    assert default_nproc_per_node(tp, gpu_count=8) == 8  # 2 data-parallel groups of cp 2 × tp 2
    with pytest.raises(
        LaunchError, match=r"groups of context_parallel_size × dp_replicate_size × tensor_parallel"
    ):
        default_nproc_per_node(tp, gpu_count=6)
    with pytest.raises(LaunchError) as error:
        default_nproc_per_node(recipe(context_parallel_size=3), gpu_count=8)
    assert str(error.value).startswith(
        "8 GPU(s) are visible, which cannot be split into groups of context_parallel_size × dp_replicate_size = 3"
    )
