"""A refusal inside a rank started by torchrun or ``accelerate launch`` reaches the launcher's failure summary."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cptune.run.training.distributed import report_to_elastic_agent

REFUSAL = "cptune error: output_dir: 'outputs/quickstart' already holds an earlier run"


def test_the_launchers_summary_shows_cptunes_message_instead_of_a_pointer_to_its_docs(tmp_path):
    error_file = tmp_path / "error.json"
    report_to_elastic_agent(REFUSAL, {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    # What torch's elastic agent does with a failed rank's error file (torch/distributed/elastic).
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("cptune", {0: failure}).format_msg()
    assert f"traceback : {REFUSAL}\n" in summary
    assert "To enable traceback" not in summary


def test_nothing_is_written_without_an_elastic_agent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report_to_elastic_agent(REFUSAL, {})
    assert list(tmp_path.iterdir()) == []
