"""The ``cptune`` command line: train, preprocess, validate, evaluate, merge-lora, inference.

Errors a user can cause (:class:`~cptune.errors.CptuneError`) are printed as one
message without a traceback, and the command exits non-zero.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from cptune.console import progress_bars_on_terminal_only, quiet_upstream_noise
from cptune.errors import CptuneError

app = typer.Typer(
    name="cptune",
    help="Fine-tune language models on very long sequences with exact context parallelism.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

OVERRIDES_HELP = "Recipe overrides as --key=value (nested keys with dots, e.g. --datasets.0.path=x.jsonl)."
_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}

RecipeArg = Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)]


def _setup_logging(rank: int = 0) -> None:
    quiet_upstream_noise()
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")
    logging.getLogger("cptune").setLevel(level)


@dataclass(frozen=True)
class _Invocation:
    """How :func:`main` was called (the click context's ``obj``).

    ``owns_process``: cptune is this process's program (the console script, ``python -m cptune``, a
    rank a launcher started), so this process runs this one command and its one recipe; not so when
    a user's own process calls ``main(argv)`` (a notebook, the tests' ``cptune_in_process``), where a
    later call could need what this one leaves out.
    """

    owns_process: bool


def _load(recipe: Path, ctx: typer.Context):
    from cptune.config.loader import load_recipe

    _refuse_underscored_options(ctx)
    return load_recipe(recipe, list(ctx.args))


def _leave_out_unused_imports(ctx: typer.Context, loaded, checkpoint: Path | None = None) -> None:
    """Before transformers is imported: where this process exists for ``loaded`` alone, keep out what it does not use.

    bitsandbytes: about a second of start-up (cptune.run.training.unused_imports) in every process
    whose command imports peft or the Trainer, for a recipe that neither quantizes nor uses its
    optimizers.
    """
    from cptune.run.training.distributed import under_launcher

    if under_launcher() or (isinstance(ctx.obj, _Invocation) and ctx.obj.owns_process):
        from cptune.run.training.unused_imports import leave_out_bitsandbytes

        leave_out_bitsandbytes([loaded], models=[checkpoint] if checkpoint is not None else ())


def _refuse_underscored_options(ctx: typer.Context) -> None:
    """Refuse an option written with underscores (torchrun's ``--nproc_per_node``).

    Unknown options are recipe overrides, so ``--nproc_per_node=2`` would be read
    as a recipe key and fail as an unknown key, which hides the real mistake.
    """
    options = {opt for param in ctx.command.params for opt in param.opts if opt.startswith("--")}
    for arg in ctx.args:
        name = arg.partition("=")[0]
        dashed = name.replace("_", "-")
        if dashed != name and dashed in options:
            raise CptuneError(
                f"{name}: cptune spells this option {dashed} (with dashes); written with underscores it "
                f"would be read as a recipe key. Use {dashed}."
            )


def _nproc_per_node(nproc_per_node: int | None, nnodes: int, recipe) -> int:
    """Processes per node: ``--nproc-per-node``, by default the recipe's layout; both options checked."""
    from cptune.errors import LaunchError

    for option, value, what in (
        ("--nproc-per-node", nproc_per_node, "process per node"),
        ("--nnodes", nnodes, "node"),
    ):
        if value is not None and value < 1:
            raise LaunchError(f"{option}: got {value}, but a run needs at least 1 {what}; give 1 or more.")
    if nproc_per_node is not None:
        return nproc_per_node
    from cptune.run.launch.processes import default_nproc_per_node, visible_gpu_count

    # One process per visible GPU on a GPU node (dp = GPUs / cp); the recipe's layout on CPU.
    return default_nproc_per_node(recipe, visible_gpu_count())


def _with_flags(loaded, recipe: Path, *, resume: bool, overwrite: bool):
    """The recipe with ``--resume`` / ``--overwrite`` set, validated like the keys they stand for."""
    from cptune.config.loader import validate_recipe

    updates: dict[str, object] = {}
    if resume and not loaded.resume_from_checkpoint:
        updates["resume_from_checkpoint"] = True
    if overwrite:
        updates["overwrite_output_dir"] = True
    if not updates:
        return loaded
    # Validated again, so that e.g. --resume with overwrite_output_dir: true is refused like in a recipe.
    return validate_recipe({**loaded.model_dump(), **updates}, source=str(recipe))


@app.command(context_settings=_EXTRA, help=f"Train as the recipe says. {OVERRIDES_HELP}")
def train(
    ctx: typer.Context,
    recipe: RecipeArg,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            help="Processes to start on this node (default: one per visible GPU on a GPU node; without GPUs the recipe's dp_replicate_size × dp_shard_size × context_parallel_size)."
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="Number of nodes (multi-node runs go through torchrun).")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's rank (multi-node).")] = 0,
    master_addr: Annotated[str | None, typer.Option(help="Address of the rank-0 node.")] = None,
    master_port: Annotated[int | None, typer.Option(help="Port of the rank-0 node.")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="torchrun rendezvous endpoint.")] = None,
    rdzv_backend: Annotated[str | None, typer.Option(help="torchrun rendezvous backend.")] = None,
    rdzv_id: Annotated[str | None, typer.Option(help="torchrun rendezvous id.")] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue from the newest complete checkpoint in output_dir "
            "(same as resume_from_checkpoint: true).",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start afresh even if output_dir holds an earlier run, removing its checkpoints and "
            "train log (same as overwrite_output_dir: true).",
        ),
    ] = False,
    data_reported: Annotated[
        bool,
        typer.Option(
            "--data-reported",
            hidden=True,
            help="Set by cptune's launcher for its ranks: its preflight prepared the data and reported it.",
        ),
    ] = False,
) -> None:
    from cptune.run.training.distributed import close_process_groups, read_dist_env, under_launcher

    env = read_dist_env()
    _setup_logging(env.rank)
    if data_reported:
        # cptune's launcher imported the backend in its preflight and listed the patches of that
        # import; this rank imports it again, silently, so that a run lists them once.
        from cptune.patches.core import IMPORT_TIME_LOG

        logging.getLogger(IMPORT_TIME_LOG).setLevel(logging.WARNING)
    flags = [*(["--resume"] if resume else []), *(["--overwrite"] if overwrite else [])]
    # The recipe is checked before torch and transformers are imported: a typo fails in a second.
    loaded = _with_flags(_load(recipe, ctx), recipe, resume=resume, overwrite=overwrite)
    from cptune.run.training.run_recipe import resumed_recipe

    # A resume continues its run: the overrides that run was started with apply again.
    loaded, reapplied = resumed_recipe(loaded, recipe, ctx.args)
    # Said once: by the launcher, or by rank 0 where no cptune launcher started the ranks.
    if reapplied and env.rank == 0 and not data_reported:
        logging.getLogger("cptune.train").info(
            "--resume: continuing with the overrides the run was started with: %s", " ".join(reapplied)
        )
    from cptune.models.hub import check_hub_ids

    check_hub_ids(loaded)  # before torch is imported: a hub id that cannot be fetched fails in a second
    progress_bars_on_terminal_only()
    from cptune.run.launch.allocator import use_expandable_segments

    # Before anything initialises CUDA; the ranks started below inherit it. A rank under a launcher
    # sets it only where the launcher did not (the launcher said what it kept).
    use_expandable_segments(os.environ, loaded.memory_features, note=not under_launcher())
    from cptune.run.launch.preflight import preflight
    from cptune.run.launch.processes import LaunchPlan, launch
    from cptune.run.plan import RunPlan

    _leave_out_unused_imports(ctx, loaded)  # the recipe as it trains, resumed overrides and all
    if under_launcher():
        from cptune.run.training.train import train as run_train

        result = run_train(loaded, data_reported=data_reported, overrides=ctx.args)
        close_process_groups()
        if env.rank == 0:
            typer.echo(
                f"cptune: training finished in {result.seconds:.1f} s; model saved to {result.output_dir}"
            )
        return
    launching = LaunchPlan(
        nproc_per_node=_nproc_per_node(nproc_per_node, nnodes, loaded),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_id=rdzv_id,
    )
    plan = RunPlan.build(loaded, launching.world_size)
    preflight(
        plan,
        prepare_data=node_rank == 0 or not launching.multi_node,
        processes_per_node=launching.nproc_per_node,
    )
    if launching.world_size == 1 and not plan.dims.sharded:
        # In this process. FSDP2 (offloaded states at world size 1) needs a process group: a launched rank.
        from cptune.run.training.train import train as run_train

        result = run_train(loaded, plan=plan, data_reported=True, overrides=ctx.args)
        close_process_groups()
        typer.echo(f"cptune: training finished in {result.seconds:.1f} s; model saved to {result.output_dir}")
        return
    # The ranks of a node whose preflight prepared no data (multi-node, node_rank > 0) are not rank 0.
    code = launch(launching, ["train", str(recipe), *ctx.args, *flags, "--data-reported"])
    if code:
        raise typer.Exit(code)


@app.command(
    context_settings=_EXTRA,
    help="Tokenize, pack and cache the data (from the cache when it is there), then print what it holds: "
    f"the counts, rows with the trained tokens marked (--debug), or a data report (--report). {OVERRIDES_HELP}",
)
def preprocess(
    ctx: typer.Context,
    recipe: RecipeArg,
    debug: Annotated[
        bool, typer.Option("--debug", help="Print training rows decoded, with the trained tokens marked.")
    ] = False,
    rows: Annotated[
        int | None,
        typer.Option("--rows", min=1, help="Rows to print with --debug (default 3; implies --debug)."),
    ] = None,
    report: Annotated[
        bool,
        typer.Option(
            "--report",
            help="Print the data report (lengths against sequence_len, packing, attention balance at the "
            "recipe's context_parallel_size, tokens per step) and write it as report.txt and report.html "
            "into the cache folder.",
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of text (the counts, rows and/or report).")
    ] = False,
) -> None:
    from cptune.run.commands.preprocess_view import run_preprocess

    _setup_logging()
    loaded = _load(recipe, ctx)
    _leave_out_unused_imports(ctx, loaded)
    progress_bars_on_terminal_only()
    debug = debug or rows is not None
    typer.echo(
        run_preprocess(loaded, debug_rows=(rows or 3) if debug else 0, report=report, as_json=json_output)
    )


@app.command(context_settings=_EXTRA, help=f"Check the recipe and print the plan. {OVERRIDES_HELP}")
def validate(
    ctx: typer.Context,
    recipe: RecipeArg,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            help="Processes per node the run will use (default: one per visible GPU on a GPU node; without GPUs the recipe's dp_replicate_size × dp_shard_size × context_parallel_size)."
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes the run will use.")] = 1,
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            help="GiB of memory per GPU to estimate against (default: this machine's GPU; without one, the estimate is a plan for an H100 80GB)."
        ),
    ] = None,
    host_memory: Annotated[
        float | None,
        typer.Option(
            help="GiB of host RAM per node to plan the offloaded activations for (default: the RAM this machine has available now, /proc/meminfo MemAvailable); a run whose pinned layer inputs need more than 90% of it is refused."
        ),
    ] = None,
) -> None:
    _setup_logging()
    # The recipe is checked before torch, datasets and transformers are imported: a typo fails in a second.
    loaded = _load(recipe, ctx)
    from cptune.models.hub import check_hub_ids

    # A hub id that cannot be fetched from here stops everything else: said at once, in one line,
    # before torch and transformers are imported.
    check_hub_ids(loaded)
    _leave_out_unused_imports(ctx, loaded)
    from cptune.data.first_rows import first_row_problems
    from cptune.data.sources import source_problems
    from cptune.errors import RecipeError, RecipeProblem
    from cptune.models.loading import load_tokenizer
    from cptune.run.launch.preflight import describe_plan
    from cptune.run.plan import RunPlan

    # Missing or unreadable data files, and the first rows of each that its dataset type cannot use,
    # are found first (no model loaded) and reported together with what the plan finds, so that one
    # run of validate names every problem it can see.
    problems = source_problems(loaded)
    tokenizer, tokenizer_error = None, None
    try:
        tokenizer = load_tokenizer(loaded)
    except CptuneError as err:
        tokenizer_error = err
    else:
        problems += first_row_problems(loaded, tokenizer)
    try:
        per_node = _nproc_per_node(nproc_per_node, nnodes, loaded)
        plan = RunPlan.build(loaded, per_node * nnodes)
        described = describe_plan(
            plan,
            processes_per_node=per_node,
            gpu_memory_gib=gpu_memory,
            host_memory_gib=host_memory,
            tokenizer=tokenizer,
        )
    except CptuneError as err:
        # A base_model that gives no config gives no tokenizer either: its one problem is the config's.
        if not loaded.tokenizer_config and str(err).startswith("base_model:"):
            tokenizer_error = None
        if not problems and tokenizer_error is None:
            raise
        problems.append(RecipeProblem("", str(err)))
    if tokenizer_error is not None:
        problems.append(RecipeProblem("", str(tokenizer_error)))
    if problems:
        raise RecipeError(problems, source=str(recipe))
    typer.echo(described)


CheckpointOption = Annotated[
    Path | None,
    typer.Option(help="output_dir or a checkpoint-N folder holding a LoRA adapter or a full model."),
]


@app.command(
    context_settings=_EXTRA,
    help="Loss and perplexity on the recipe's evaluation data (val_set_size or test_datasets), "
    f"split across processes like training. {OVERRIDES_HELP}",
)
def evaluate(
    ctx: typer.Context,
    recipe: RecipeArg,
    checkpoint: CheckpointOption = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            help="Processes to start (default: one per visible GPU on a GPU node; without GPUs the recipe's dp_replicate_size × dp_shard_size × context_parallel_size); one node only."
        ),
    ] = None,
) -> None:
    import json

    from cptune.run.commands.evaluate import check_eval_data, check_preference_source
    from cptune.run.commands.evaluate import evaluate as run_evaluate
    from cptune.run.commands.weights import model_source
    from cptune.run.launch.preflight import preflight
    from cptune.run.launch.processes import LaunchPlan, launch
    from cptune.run.plan import RunPlan
    from cptune.run.training.distributed import close_process_groups, read_dist_env, under_launcher

    env = read_dist_env()
    _setup_logging(env.rank)
    loaded = _load(recipe, ctx)
    _leave_out_unused_imports(ctx, loaded, checkpoint)
    progress_bars_on_terminal_only()
    launching = LaunchPlan(nproc_per_node=_nproc_per_node(nproc_per_node, 1, loaded))
    plan = None
    if not under_launcher():
        # A recipe without evaluation data or a wrong path fails here, before any process starts.
        check_eval_data(loaded)
        check_preference_source(loaded, model_source(checkpoint))
        plan = RunPlan.build(loaded, launching.world_size)
        preflight(plan, training=False)
    if under_launcher() or launching.world_size == 1:
        metrics = run_evaluate(loaded, checkpoint, plan=plan)
        close_process_groups()
        if env.rank == 0:
            typer.echo(json.dumps(metrics))
        return
    args = ["evaluate", str(recipe), *ctx.args]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    code = launch(launching, args)
    if code:
        raise typer.Exit(code)


@app.command(
    name="merge-lora",
    context_settings=_EXTRA,
    help=f"Merge the trained LoRA adapter into the base model and save a standalone model. {OVERRIDES_HELP}",
)
def merge_lora(
    ctx: typer.Context,
    recipe: RecipeArg,
    checkpoint: CheckpointOption = None,
    out: Annotated[
        Path | None, typer.Option(help="Where to save the merged model (default: output_dir/merged).")
    ] = None,
) -> None:
    from cptune.run.commands.merge import merge_lora as run_merge

    _setup_logging()
    loaded = _load(recipe, ctx)
    _leave_out_unused_imports(ctx, loaded, checkpoint)
    progress_bars_on_terminal_only()
    target = run_merge(loaded, checkpoint, out)
    typer.echo(f"cptune: merged model saved to {target}")


@app.command(
    context_settings=_EXTRA,
    help="Generate from the trained model (the base model with output_dir's adapter by default) with "
    "prompts in the training format of the recipe's first dataset; greedy unless --do-sample. Without "
    f"--prompt or --prompts, each line of standard input is a prompt. {OVERRIDES_HELP}",
)
def inference(
    ctx: typer.Context,
    recipe: RecipeArg,
    checkpoint: CheckpointOption = None,
    base: Annotated[bool, typer.Option("--base", help="Use the base model alone (to compare).")] = False,
    prompt: Annotated[
        str | None, typer.Option(help="The prompt: an instruction, a user message or text.")
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help="A file of prompts: one per line, or a .jsonl file of rows in the data's format."),
    ] = None,
    score: Annotated[
        str | None,
        typer.Option(
            help="Print the log-likelihood of this completion after each prompt instead of generating."
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate per prompt.")] = 128,
    do_sample: Annotated[
        bool, typer.Option("--do-sample", help="Sample instead of greedy decoding.")
    ] = False,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature (with --do-sample).")
    ] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling share (with --do-sample).")] = None,
    top_k: Annotated[
        int | None, typer.Option(help="Sample among the k likeliest tokens (with --do-sample).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed for sampling (default: the recipe's seed).")
    ] = None,
) -> None:
    from cptune.run.commands.inference import GenerationOptions, run_inference

    _setup_logging()
    loaded = _load(recipe, ctx)
    _leave_out_unused_imports(ctx, loaded, checkpoint)
    progress_bars_on_terminal_only()
    options = GenerationOptions(max_new_tokens, do_sample, temperature, top_p, top_k)
    if prompt is None and prompts is None and sys.stdin.isatty():
        print("Type a prompt and press Enter (Ctrl-D to end).", file=sys.stderr)
    run_inference(
        loaded,
        checkpoint=checkpoint,
        base=base,
        prompt=prompt,
        prompts=prompts,
        completion=score,
        options=options,
        stdin=sys.stdin,
        echo=typer.echo,
        seed=loaded.seed if seed is None else seed,
    )


def _print_stacks_on_fatal_signals() -> None:
    """Print every thread's Python stack to stderr when this process dies of SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE or SIGILL (:mod:`faulthandler`), unless a handler is already set (``-X faulthandler``,
    ``PYTHONFAULTHANDLER``).

    A rank that crashes in native code (glibc's "malloc(): unaligned tcache chunk detected" and its
    SIGABRT, a segfault in a kernel or in gloo) otherwise ends with one line from the C library and
    nothing that names the Python code it was running; the launcher only says which signal ended it.
    faulthandler writes without allocating, so it works with a corrupted heap, and the process still
    dies of the same signal (the launcher reports the same code).
    """
    if faulthandler.is_enabled():
        return
    stderr = sys.__stderr__
    # A stderr without a file descriptor (an embedding host): no handler rather than no command.
    with contextlib.suppress(AttributeError, ValueError):
        faulthandler.enable(file=stderr if stderr is not None else 2, all_threads=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    _print_stacks_on_fatal_signals()
    try:
        # Outside standalone mode click returns (not raises) the code of typer.Exit.
        # Called without argv, cptune is this process's program: it reads sys.argv.
        code = app(args=argv, standalone_mode=False, obj=_Invocation(owns_process=argv is None))
    except CptuneError as err:
        from cptune.run.training.distributed import report_to_elastic_agent

        rank = _rank_prefix()
        print(f"{rank}error: {err}", file=sys.stderr)
        report_to_elastic_agent(f"cptune error: {err}")
        sys.exit(err.exit_code)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as err:  # click usage errors arrive here in non-standalone mode
        import click

        from cptune.run.training.distributed import collective_timeout_message

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        timed_out = collective_timeout_message(err)
        if timed_out is not None:
            print(f"{_rank_prefix()}error: {timed_out}", file=sys.stderr)
            sys.exit(1)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)


def _rank_prefix() -> str:
    from cptune.run.training.distributed import read_dist_env

    env = read_dist_env()
    return f"[rank {env.rank}] " if env.launched else ""
