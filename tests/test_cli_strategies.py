"""Every layout of `python -m scalebook.train` is one process's training: PyTorch's DDP and FSDP2, the book's
DDP (Ch. 10) and ZeRO stages (Ch. 11), tensor (Ch. 12), pipeline (Ch. 13), context and expert parallelism and
their compositions (Ch. 14) give the single-process losses and gradient norms (before clipping), resume
bit-identically from their checkpoints and consolidate into the single-process model; and every impossible
layout fails with one message naming the flag to change, before any rank starts work.

The runs go through the CLI's own ``run(args)`` on ranks started by :func:`scalebook.comm.launch`, several
layouts per launch (starting ranks costs seconds on two cores; ``tests/test_cli.py`` keeps the real
``torchrun`` and ``python -m scalebook.train`` runs)."""

import argparse

import pytest
import torch
import torch.distributed as dist
from test_train import plain_pytorch_training

from scalebook import data
from scalebook.comm import free_port, launch
from scalebook.model import GPT
from scalebook.train import checkpoint, cli
from scalebook.train.preflight import model_config

# One micro-batch of one sequence: the single process accumulates 4 micro-batches per step, each of two
# replicas 2, so gradient accumulation (no_sync, ZeRO-2/3's sum of reduce-scattered shards) is used; the
# pipelines run 1F1B over the 4 micro-batches. The gradient norm is 2 to 9 in these steps (measured), so
# the clipping at 1.0 acts on every step.
SMALL = ["--steps", "6", "--micro-batch", "1", "--global-batch", "4", "--seq-len", "32", "--no-progress",
         "--log-every", "100", "--checkpoint-every", "2"]  # fmt: skip
MOE = ["--moe-experts", "4"]  # four experts per MLP, top-2 routing, dropless
# Two ranks, two launches: the data-parallel wrappers, and the model-parallel dimensions.
WRAPPERS = {
    "ddp": ["--strategy", "ddp", "--bucket-cap-mb", "0.5"],  # 0.5 MiB: 7 buckets of the tiny GPT's 3 MiB
    "torch-ddp": ["--strategy", "torch-ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "zero1": ["--strategy", "zero1"],
    "zero2": ["--strategy", "zero2"],
    "zero3": ["--strategy", "zero3"],
}
DIMENSIONS = {
    "tp": ["--strategy", "tp", "--tp", "2"],
    "tp + sp": ["--strategy", "tp", "--tp", "2", "--sequence-parallel"],  # LayerNorms on 16 tokens per rank
    "pp": ["--strategy", "pp", "--pp", "2"],  # 2 layers per stage
    "cp": ["--strategy", "ddp", "--cp", "2"],  # each sequence in 4 chunks of 8 tokens, zig-zag
    "ep": ["--strategy", "ddp", "--ep", "2", *MOE],  # two experts per rank
}
FOUR_RANKS = {
    # Each stage tensor-parallel: replicated parameters and the tied embedding's two copies (first and last
    # stage) must each count once in the gradient norm.
    "3d": ["--strategy", "3d", "--dp", "1", "--tp", "2", "--pp", "2"],
    "dp2 x pp2": ["--strategy", "3d", "--dp", "2", "--pp", "2"],  # each replica pipelines half the batch
    "zero1 dp2 x tp2": ["--strategy", "zero1", "--tp", "2"],
    "dp2 x cp2": ["--strategy", "ddp", "--cp", "2"],  # gradients averaged over the 4 dp x cp ranks
    "tp2 x cp2": ["--strategy", "ddp", "--tp", "2", "--cp", "2"],  # ring attention over tensor-parallel heads
    "dp4 x ep2": ["--strategy", "ddp", "--ep", "2", *MOE],  # two replicas of each expert, averaged
}


def args_of(argv: list[str], **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(cli.build_parser().parse_args(argv)), **changes})


def steps(records) -> list[tuple[float, float]]:
    return [(r.loss, r.grad_norm) for r in records]


def train_layouts(layouts: dict[str, list[str]], root: str) -> dict:
    """Worker: each layout trained 6 steps (checkpoints at 2, 4 and 6), then resumed from step 4; on rank 0,
    per layout, both runs' (loss, grad norm) per step and the consolidated model of the resumed run."""
    results = {}
    for name, argv in layouts.items():
        ckpt = f"{root}/{name.replace(' ', '_')}"
        full = cli.run(args_of([*SMALL, *argv], checkpoint_dir=ckpt))
        if dist.get_rank() == 0:
            checkpoint.mark_complete(ckpt, 4)  # as if the run had died after saving step 4
        dist.barrier()
        resumed = cli.run(args_of([*SMALL, *argv], checkpoint_dir=ckpt, resume=True))
        if dist.get_rank() == 0:
            results[name] = {"full": steps(full), "resumed": steps(resumed), "model": checkpoint.consolidate(ckpt)}
    return results


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, tuple[list, dict]]:
    """The references: one process (one thread, as the ranks), the whole global batch, the dense GPT and its
    mixture-of-experts variant; their (loss, grad norm) per step and final weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        references = {}
        for name, extra in {"dense": [], "moe": MOE}.items():
            ckpt = tmp_path_factory.mktemp(name)
            records = cli.run(args_of([*SMALL, *extra], checkpoint_dir=str(ckpt)))
            references[name] = steps(records), checkpoint.consolidate(ckpt)[0]
    finally:
        torch.set_num_threads(threads)
    return references


@pytest.fixture(scope="module")
def wrappers(tmp_path_factory) -> dict:
    return launch(train_layouts, 2, WRAPPERS, str(tmp_path_factory.mktemp("wrappers")), timeout=240)[0]


@pytest.fixture(scope="module")
def dimensions(tmp_path_factory) -> dict:
    return launch(train_layouts, 2, DIMENSIONS, str(tmp_path_factory.mktemp("dimensions")), timeout=240)[0]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    return launch(train_layouts, 4, FOUR_RANKS, str(tmp_path_factory.mktemp("four")), timeout=240)[0]


def assert_is_one_process(run: dict, reference: tuple[list, dict], world_size: int) -> None:
    """Every step's loss and gradient norm before clipping equal one process's to float32 rounding; the
    resumed run repeats steps 5 and 6 bit for bit; rank 0's checkpoint holds the single-process model.

    The same arithmetic in a different summation order (gradients summed over ranks, norms over shards,
    tensor-parallel partial sums, ring attention's online softmax): losses agree to 1e-6 relative, gradient
    norms to ~1e-7 measured (1e-6 under ring attention), checked at 1e-5. The norm is the stronger check:
    AdamW divides a constant factor on the gradients out of its update, so a missing 1/d (gradients summed
    over d replicas instead of averaged) hides in the losses, but it multiplies the norm by d from step 1.
    """
    reference_steps, reference_model = reference
    assert len(run["full"]) == len(reference_steps) == 6
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(run["full"], reference_steps, strict=True)):
        assert norm == pytest.approx(ref_norm, rel=1e-5), ("grad norm", step + 1)
        assert loss == pytest.approx(ref_loss, rel=1e-6), ("loss", step + 1)
    assert run["full"][-1][0] < run["full"][0][0] - 0.5  # it learns (and does not match by chance)
    assert min(norm for _, norm in reference_steps) > 1.5  # so clipping at 1.0 acts on every step
    # Bit-identical: the resumed steps are those of the run that never stopped.
    assert run["resumed"] == run["full"][4:]
    state, meta = run["model"]
    assert (meta["step"], meta["world_size"]) == (6, world_size)
    assert sorted(state) == sorted(reference_model)  # every name of the single-process GPT, the tied head too
    for name, tensor in reference_model.items():
        # After 6 Adam steps the float32 rounding above reaches ~1e-6 in most weights. Adam's step m / sqrt(v) is
        # scale-free, though: an element whose gradient is near zero turns rounding into a different step, a
        # fraction of lr = 3e-3 (measured at most 1.5e-5, in one element of 65,536 under ring attention).
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_the_one_process_reference_is_a_plain_pytorch_loop(single, name):
    """The reference every layout is compared with (the CLI on one process, through ParallelModel and the book's
    loop) against plain PyTorch on the same model, weights and data: torch.optim.AdamW, the step's 4 sequences as
    4 micro-batches of 1 (for the mixture of experts; one forward of 4 for the dense GPT), and
    torch.nn.utils.clip_grad_norm_ (tests/test_train.py's plain_pytorch_training). Losses and gradient norms before
    clipping to float32 rounding, as assert_is_one_process: rel 1e-6 and 1e-5."""
    extra = {"dense": [], "moe": MOE}[name]
    args = args_of([*SMALL, *extra])
    torch.manual_seed(args.seed)
    model = GPT(model_config(args))  # the CLI's --model and --moe-experts: the model, not the loop
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference ran
    try:
        reference = plain_pytorch_training(model, data.load_tokens(None), steps=6, batch_size=4, seq_len=32,
                                           micro_batches=4 if extra else 1, warmup_steps=args.warmup_steps,
                                           lr=args.lr, min_lr=args.min_lr, seed=args.seed)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    ours = single[name][0]
    assert len(ours) == len(reference) == 6
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, reference, strict=True)):
        assert norm == pytest.approx(ref_norm, rel=1e-5), ("grad norm", step + 1)
        assert loss == pytest.approx(ref_loss, rel=1e-6), ("loss", step + 1)


@pytest.mark.parametrize("layout", WRAPPERS)
def test_data_parallel_wrapper_on_two_ranks_is_one_process(layout, wrappers, single):
    assert_is_one_process(wrappers[layout], single["dense"], 2)


@pytest.mark.parametrize("layout", DIMENSIONS)
def test_parallel_dimension_on_two_ranks_is_one_process(layout, dimensions, single):
    assert_is_one_process(dimensions[layout], single["moe" if "--ep" in DIMENSIONS[layout] else "dense"], 2)


def test_a_data_parallel_wrapper_on_one_process_is_one_process(single, monkeypatch):
    # The wrapper runs on a process group of one rank, which the CLI starts (at a free port: a launcher's variables,
    # as torchrun would set them) and ends itself.
    for name, value in {"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}.items():
        monkeypatch.setenv(name, str(value))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = cli.run(args_of([*SMALL, "--strategy", "zero3", "--steps", "2"]))
    finally:
        torch.set_num_threads(threads)
    assert not dist.is_initialized()
    # Steps 1 and 2 do not depend on --steps (the warm-up sets their learning rates). One rank sums in the
    # single process's order (bit for bit, measured); 1e-6 leaves room for a wrapper that reorders them.
    for got, expected in zip(steps(records), single["dense"][0][:2], strict=True):
        assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("layout", FOUR_RANKS)
def test_four_rank_layout_is_one_process(layout, four_ranks, single):
    assert_is_one_process(four_ranks[layout], single["moe" if "--ep" in FOUR_RANKS[layout] else "dense"], 4)


# ----- impossible layouts: one message, naming the flag, before any process group exists ------------------

IMPOSSIBLE = [
    (["--tp", "2", "--pp", "2"], 2, "dp x tp x pp x cp = 1 x 2 x 2 x 1 = 4 must equal the 2 ranks started"),
    (["--strategy", "ddp", "--dp", "2", "--tp", "2"], 2, "= 4 must equal the 2 ranks started; e.g. --dp 1"),
    (["--tp", "3"], 3, "--tp 3: invalid tensor-parallel layout: n_head (4) must be divisible by tp (3)"),
    (["--model", "gpt2", "--tp", "2"], 2, "--tp 2: invalid tensor-parallel layout: vocab_size (50257) must be "
     "divisible by tp (2) for the vocabulary-parallel embedding; pad the vocabulary to 50258"),
    (["--strategy", "ddp", "--ep", "4", "--moe-experts", "6", "--micro-batch", "2"], 4, "--ep 4: the 6 experts"),
    (["--strategy", "ddp", "--ep", "2"], 2, "--ep 2 shards the experts of a mixture-of-experts model: add --moe"),
    (["--strategy", "ddp", "--ep", "3", "--moe-experts", "6"], 2, "--ep 3 must divide the data-parallel degree dp = 2"),
    (["--pp", "3"], 3, "--pp 3: the 4 layers must split evenly over the stages; choose --pp from [1, 2, 4]"),
    (["--strategy", "3d", "--dp", "2", "--pp", "2", "--micro-batch", "4", "--global-batch", "8"], 4, "--pp 2: the "
     "1F1B schedule needs at "
     "least as many micro-batches per step as stages, got --global-batch / (--micro-batch x dp) = 8 / (4 x 2) = 1"),
    (["--strategy", "ddp", "--cp", "2", "--seq-len", "30"], 2, "--cp 2: invalid context-parallel layout: ring "
     "attention cuts the sequence into 4 equal chunks, so seq_len (30) must be divisible by 4"),
    (["--strategy", "zero3", "--pp", "2"], 4, "--strategy zero3 with --pp 2: ZeRO-3 is not composed with the 1F1B"),
    (["--strategy", "zero2", "--tp", "2"], 4, "--strategy zero2 with --tp 2: gathering the full model"),
    (["--strategy", "fsdp", "--tp", "2"], 4, "--strategy fsdp with --tp 2: FSDP2 composes with DTensor"),
    (["--strategy", "torch-ddp", "--pp", "2"], 4, "--strategy torch-ddp with --pp 2: PyTorch's DDP averages"),
    (["--strategy", "zero1", "--ep", "2", *MOE], 2, "--strategy zero1 with --ep 2: would average (or shard)"),
    (["--strategy", "ddp", "--cp", "2", "--pp", "2"], 4, "--cp 2 with --pp 2: the pipeline runtime passes"),
    (["--global-batch", "7"], 1, "--global-batch (7) must be a multiple of --micro-batch x dp = 4 x 1 = 4; "
     "e.g. --global-batch 4"),
    ([], 2, "dp x cp = 2 x 1 replicas need a data-parallel wrapper to average their gradients: choose --strategy"),
    (["--seq-len", "256"], 1, "--seq-len 256 exceeds the model's context of 128 tokens"),
    (["--sequence-parallel"], 1, "--sequence-parallel splits the sequence over the tensor-parallel ranks: add --tp"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "33"], 2, "seq_len (33) must be divisible by tp (2) under "
     "sequence parallelism"),
    (["--strategy", "ddp", "--tp", "2", "--cp", "2", "--sequence-parallel"], 4, "--sequence-parallel with --cp 2"),
    (["--tp", "2", "--pp", "2", "--sequence-parallel"], 4, "--sequence-parallel with --pp 2: the pipeline runtime"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "world_size", "message"), IMPOSSIBLE, ids=[" ".join(a) for a, *_ in IMPOSSIBLE])
def test_an_impossible_layout_is_refused_naming_the_flag(argv, world_size, message):
    with pytest.raises(ValueError) as error:
        cli.layout(cli.build_parser().parse_args(argv), world_size)
    assert message in str(error.value)
    assert str(error.value).count("\n") == 1  # this problem only: no echo of it in other words


def test_every_problem_is_reported_at_once_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--strategy", "zero3", "--tp", "3", "--pp", "8", "--cp", "2", "--seq-len", "30", "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for fragment in ("--resume needs --checkpoint-dir", "dp x tp x pp x cp = 1 x 3 x 8 x 2 = 48 must equal the 1 "
                     "ranks started", "n_head (4) must be divisible by tp (3)", "choose --pp from [1, 2, 4]",
                     "seq_len (30) must be divisible by 4", "--strategy zero3 with --pp 8",
                     "--strategy zero3 with --tp 3", "--cp 2 with --pp 8"):  # fmt: skip
        assert fragment in err


def test_valid_layouts_give_the_degrees_and_micro_batches():
    def dims(argv, world_size):
        d = cli.layout(cli.build_parser().parse_args(argv), world_size)
        return d.dp, d.tp, d.pp, d.cp, d.ep, d.data_parallel, d.micro_batches

    assert dims(["--strategy", "tp", "--tp", "2"], 2) == (1, 2, 1, 1, 1, "ddp", 2)  # both ranks share each micro-batch
    assert dims(["--strategy", "zero3", "--global-batch", "16"], 2) == (2, 1, 1, 1, 1, "zero3", 2)
    assert dims(["--strategy", "pp", "--pp", "4", "--global-batch", "16"], 4) == (1, 1, 4, 1, 1, "ddp", 4)
    argv = ["--strategy", "3d", "--tp", "2", "--pp", "2", "--micro-batch", "1", "--global-batch", "4"]
    assert dims(argv, 8) == (2, 2, 2, 1, 1, "ddp", 2)  # dp = the ranks left; each replica pipelines 2 micro-batches
    assert dims(["--strategy", "ddp", "--ep", "2", "--micro-batch", "2", *MOE], 4) == (4, 1, 1, 1, 2, "ddp", 1)
