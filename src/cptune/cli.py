"""The ``cptune`` command line: train, preprocess, validate, evaluate, merge-lora.

Errors a user can cause (:class:`~cptune.errors.CptuneError`) are printed as one
message without a traceback, and the command exits non-zero.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

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


# Deprecation notices from upstream code cptune cannot change (ring-flash-attn's
# collectives, peft's checkpointing query); they say nothing about the user's run.
_UPSTREAM_NOISE = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"`is_gradient_checkpointing` is deprecated",
)


def _setup_logging(rank: int = 0) -> None:
    for pattern in _UPSTREAM_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")
    logging.getLogger("cptune").setLevel(level)


def _load(recipe: Path, ctx: typer.Context):
    from cptune.config.loader import load_recipe

    _refuse_underscored_options(ctx)
    return load_recipe(recipe, list(ctx.args))


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
    return recipe.default_process_count if nproc_per_node is None else nproc_per_node


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
            help="Processes to start on this node (default: the recipe's dp_replicate_size × dp_shard_size × context_parallel_size)."
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
) -> None:
    from cptune.run.distributed import read_dist_env, under_launcher

    env = read_dist_env()
    _setup_logging(env.rank)
    flags = [*(["--resume"] if resume else []), *(["--overwrite"] if overwrite else [])]
    # The recipe is checked before torch and transformers are imported: a typo fails in a second.
    loaded = _with_flags(_load(recipe, ctx), recipe, resume=resume, overwrite=overwrite)
    from cptune.run.launch import LaunchPlan, launch
    from cptune.run.preflight import preflight

    if under_launcher():
        from cptune.run.train import train as run_train

        result = run_train(loaded)
        if env.rank == 0:
            typer.echo(
                f"cptune: training finished in {result.seconds:.1f} s; model saved to {result.output_dir}"
            )
        return
    plan = LaunchPlan(
        nproc_per_node=_nproc_per_node(nproc_per_node, nnodes, loaded),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_id=rdzv_id,
    )
    preflight(loaded, world_size=plan.world_size, prepare_data=node_rank == 0 or not plan.multi_node)
    if plan.world_size == 1:
        from cptune.run.train import train as run_train

        result = run_train(loaded)
        typer.echo(f"cptune: training finished in {result.seconds:.1f} s; model saved to {result.output_dir}")
        return
    code = launch(plan, ["train", str(recipe), *ctx.args, *flags])
    if code:
        raise typer.Exit(code)


@app.command(context_settings=_EXTRA, help=f"Tokenize, pack and cache the data. {OVERRIDES_HELP}")
def preprocess(ctx: typer.Context, recipe: RecipeArg) -> None:
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer
    from cptune.parallel.backends.select import check_prepared_rows

    _setup_logging()
    loaded = _load(recipe, ctx)
    prepared = prepare_datasets(loaded, load_tokenizer(loaded))
    typer.echo(prepared.stats.format())
    typer.echo(f"cache: {prepared.path}")
    check_prepared_rows(loaded, prepared)


@app.command(context_settings=_EXTRA, help=f"Check the recipe and print the plan. {OVERRIDES_HELP}")
def validate(
    ctx: typer.Context,
    recipe: RecipeArg,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            help="Processes per node the run will use (default: the recipe's dp_replicate_size × dp_shard_size × context_parallel_size)."
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes the run will use.")] = 1,
) -> None:
    from cptune.run.preflight import describe_plan

    _setup_logging()
    loaded = _load(recipe, ctx)
    world = _nproc_per_node(nproc_per_node, nnodes, loaded) * nnodes
    typer.echo(describe_plan(loaded, world_size=world))


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
            help="Processes to start (default: the recipe's dp_replicate_size × dp_shard_size × context_parallel_size); one node only."
        ),
    ] = None,
) -> None:
    import json

    from cptune.run.distributed import read_dist_env, under_launcher
    from cptune.run.evaluate import check_eval_data, model_source
    from cptune.run.evaluate import evaluate as run_evaluate
    from cptune.run.launch import LaunchPlan, launch
    from cptune.run.preflight import preflight

    env = read_dist_env()
    _setup_logging(env.rank)
    loaded = _load(recipe, ctx)
    plan = LaunchPlan(nproc_per_node=_nproc_per_node(nproc_per_node, 1, loaded))
    if not under_launcher():
        # A recipe without evaluation data or a wrong path fails here, before any process starts.
        check_eval_data(loaded)
        model_source(checkpoint)
        preflight(loaded, world_size=plan.world_size, training=False)
    if under_launcher() or plan.world_size == 1:
        metrics = run_evaluate(loaded, checkpoint)
        if env.rank == 0:
            typer.echo(json.dumps(metrics))
        return
    args = ["evaluate", str(recipe), *ctx.args]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    code = launch(plan, args)
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
    from cptune.run.merge import merge_lora as run_merge

    _setup_logging()
    loaded = _load(recipe, ctx)
    target = run_merge(loaded, checkpoint, out)
    typer.echo(f"cptune: merged model saved to {target}")


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    try:
        # Outside standalone mode click returns (not raises) the code of typer.Exit.
        code = app(args=argv, standalone_mode=False)
    except CptuneError as err:
        rank = _rank_prefix()
        print(f"{rank}error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as err:  # click usage errors arrive here in non-standalone mode
        import click

        from cptune.run.distributed import collective_timeout_message

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
    from cptune.run.distributed import read_dist_env

    env = read_dist_env()
    return f"[rank {env.rank}] " if env.launched else ""
