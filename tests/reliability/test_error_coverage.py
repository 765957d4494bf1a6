"""Every user-facing error in ``src/`` has an entry on the troubleshooting page.

The page (docs/troubleshooting.md) is generated from the catalogue's cases, which the CLI
reproduces, and from its documented entries, which quote the source. This test finds every
place in ``src/cptune`` that raises a user-facing message (see ``error_sites.py``) and fails
when one has no entry: adding an error without saying on the page what causes it and how to
fix it fails here, with the file and line of the new message.

A fragment counts for the place whose literal text it overlaps most; wording around values
(paths, numbers) does not matter, so rewording a message breaks only the entries whose
fragment no longer appears in it (and those already fail in test_catalogue.py).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.reliability.catalogue import CASES, DOCUMENTED, SECTIONS, Documented
from tests.reliability.error_sites import Site, covered_sites, find_sites, is_carrier

SRC = REPO / "src" / "cptune"

# Messages no user can meet by a mistake of theirs, so the page has no entry for them: each
# (file, literal text of the message, why). Keep this list short; an error a user can cause
# belongs on the page.
NOT_ON_THE_PAGE: tuple[tuple[str, str, str], ...] = (
    # Bugs in cptune: the message itself asks for a report.
    (
        "src/cptune/parallel/backends/attention.py",
        "This is a bug in cptune's batching: please report it.",
        "a bug in cptune",
    ),
    (
        "src/cptune/parallel/backends/document_attention.py",
        "This is a bug in cptune's batching: please report it.",
        "a bug in cptune",
    ),
    (
        "src/cptune/parallel/backends/deepspeed_ulysses/runtime.py",
        "This is a bug in cptune's DeepSpeed setup: please report it.",
        "a bug in cptune",
    ),
    # Backstops behind a check that refuses the same input earlier (its entry is on the page).
    (
        "src/cptune/models/reference.py",
        "rl: the reference model is the base model with the LoRA adapter disabled, but this model has no adapter",
        "the recipe rule _preference refuses rl without an adapter first (rl-full-fine-tune)",
    ),
    (
        "src/cptune/parallel/preference.py",
        "this cp_backend gives no token coordinates, which preference training needs",
        "every backend gives token coordinates (BatchSharder's ShardedInputs.coords); the recipe rule _preference "
        "refuses a backend without trains_preference_pairs first (rl-cp-backend)",
    ),
    (
        "src/cptune/parallel/layout.py",
        "dp_replicate_size and tensor_parallel_size must be positive",
        "the recipe (ge=1) and the CLI (nproc-zero) refuse these first",
    ),
    (
        "src/cptune/parallel/layout.py",
        "tensor_parallel_size applies only with fsdp_version: 2.",
        "the recipe rule _tensor_parallel refuses it first (tp-without-fsdp)",
    ),
    (
        "src/cptune/parallel/layout.py",
        "dp_replicate_size applies only with fsdp_version: 2.",
        "the recipe rule _fsdp refuses it first (fsdp-keys-without-version)",
    ),
    (
        "src/cptune/parallel/backends/attention.py",
        "cptune's attention does not support attention dropout",
        "check_model_config refuses the config before launching (model-attention-dropout)",
    ),
    (
        "src/cptune/parallel/backends/document_attention.py",
        "cptune's attention does not support attention dropout",
        "check_model_config refuses the config before launching (model-attention-dropout)",
    ),
    (
        "src/cptune/parallel/backends/attention.py",
        "which cptune's context-parallel attention does not; use a model without it",
        "check_model_config refuses soft-capping before launching (model-attention-softcapping)",
    ),
    (
        "src/cptune/parallel/backends/attention.py",
        "This is a bug in cptune's model checks: please report it",
        "a bug in cptune: the backends' check_model refuses windows and sinks they cannot attend "
        "(model-sliding-window, model-attention-sinks)",
    ),
    (
        "src/cptune/parallel/backends/document_attention.py",
        "This is a bug in cptune's model checks: please report it.",
        "a bug in cptune: check_window_support refuses bidirectional windows first (model-sliding-window)",
    ),
    (
        "src/cptune/data/sources.py",
        "not one split; set",
        "load_dataset with a split and load_from_disk of one split always give one split",
    ),
    (
        "src/cptune/run/commands/evaluate.py",
        "has no evaluation split.",
        "check_eval_data refuses a recipe without evaluation data first (evaluate-without-eval-data)",
    ),
    (
        "src/cptune/run/training/eval_loop.py",
        "the evaluation data has no target tokens",
        "data preparation drops samples without trained tokens, so evaluation data always has some",
    ),
    (
        "src/cptune/run/training/preference_trainer.py",
        "the evaluation data holds no preference pair",
        "data preparation drops pairs without response tokens and refuses an empty split, so evaluation data of "
        "an rl recipe always holds a pair",
    ),
    (
        "src/cptune/run/training/eval_loop.py",
        "the evaluation data must have a length",
        "cptune always evaluates prepared, map-style datasets",
    ),
)


@functools.cache
def _sites() -> list[Site]:
    return find_sites(SRC, REPO)


def _not_on_the_page(site: Site) -> bool:
    return any(site.path == path and any(text in t for t in site.texts) for path, text, _ in NOT_ON_THE_PAGE)


def _entries() -> list[str]:
    return [case.fragment for case in CASES] + [entry.fragment for entry in DOCUMENTED]


def test_the_source_has_user_facing_errors_to_check():
    sites = _sites()
    # Guards the scanner itself: if it found nothing (a renamed base class), the test below would pass.
    assert len(sites) > 100
    assert {
        "src/cptune/config/rules.py",
        "src/cptune/data/chat_end_tokens.py",
        "src/cptune/run/commands/merge.py",
    } <= {site.path for site in sites}


def test_every_user_facing_error_has_a_troubleshooting_entry():
    sites = _sites()
    covered = covered_sites(sites, _entries())
    missing = [s for s in sites if not (is_carrier(s) or s in covered or _not_on_the_page(s))]
    assert not missing, (
        "user-facing errors without an entry on docs/troubleshooting.md; add an Entry to its section in "
        "devtools/docgen/errors/ and a Case with the same id to tests/reliability/catalogue/ (or, if the CLI "
        "cannot meet it before a run starts, a Documented entry in devtools/docgen/errors/), then "
        "run python -m devtools.docgen:\n"
        + "\n".join(f"  {s.where}: {' ... '.join(s.texts)[:160]}" for s in missing)
    )


@pytest.mark.parametrize("entry", NOT_ON_THE_PAGE, ids=lambda entry: f"{Path(entry[0]).stem}:{entry[1][:30]}")
def test_every_exemption_still_names_a_message(entry):
    path, text, _ = entry
    assert any(site.path == path and any(text in t for t in site.texts) for site in _sites()), (
        f"no message in {path} holds {text!r}: remove the exemption"
    )


@pytest.mark.parametrize("entry", DOCUMENTED, ids=lambda entry: entry.id)
def test_documented_entry_quotes_the_file_that_raises_it(entry: Documented):
    texts = [text for site in _sites() if site.path == entry.raised_in for text in site.texts]
    assert texts, f"{entry.raised_in} raises no user-facing error"
    assert any(entry.fragment in text for text in texts), (
        f"{entry.fragment!r} is no longer literal text of a message raised in {entry.raised_in}"
    )
    assert entry.section in SECTIONS


@pytest.mark.parametrize("entry", [e for e in DOCUMENTED if e.tested_by], ids=lambda entry: entry.id)
def test_documented_entry_names_a_test_that_exists(entry: Documented):
    path, _, name = (entry.tested_by or "").partition("::")
    tree = ast.parse((REPO / path).read_text())
    functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert name in functions, f"{entry.tested_by} does not exist"


def test_ids_are_unique_across_cases_and_documented_entries():
    ids = [case.id for case in CASES] + [entry.id for entry in DOCUMENTED]
    assert len(ids) == len(set(ids))


# --- the check can fail ----------------------------------------------------------------------

FAKE_ERRORS = """
class CptuneError(Exception):
    pass


class DataError(CptuneError):
    pass


class Problem(Exception):
    pass


def _problem(name: str, detail: str) -> Problem:
    return Problem(f"field {name!r} {detail}")
"""

FAKE_MODULE = """
from .errors import CptuneError, DataError


def check(recipe, rows):
    if recipe.turbo:
        raise CptuneError(f"turbo_mode: {recipe.turbo} is faster than the hardware allows; slow down.")
    if not rows:
        raise DataError(f"{recipe.path}: the data files are empty. Point path at data with rows.")
    raise CptuneError(f"{recipe.path}: the data files are unreadable. Point path at other data.")
"""


def _fake_source(tmp_path: Path) -> list[Site]:
    package = tmp_path / "src" / "fake"
    package.mkdir(parents=True)
    (package / "errors.py").write_text(FAKE_ERRORS)
    (package / "checks.py").write_text(FAKE_MODULE)
    return find_sites(package, tmp_path)


def test_a_new_error_without_an_entry_is_found(tmp_path):
    sites = _fake_source(tmp_path)
    assert len(sites) == 3  # the DataError subclass is user-facing too
    covered = covered_sites(sites, ["the data files are empty. Point path at data with rows."])
    assert {site.line for site in covered} == {9}
    # The unreadable-data message shares "the data files are " and ". Point path at " with the
    # covered one: sharing a phrase does not make it covered.
    assert {site.line for site in sites if site not in covered} == {7, 10}


def test_a_fragment_made_of_values_covers_nothing(tmp_path):
    sites = _fake_source(tmp_path)
    assert not covered_sites(sites, ["/home/user/data/train.jsonl: "])
