"""Spec for registered IPC pushes (CPU: the staging buckets go through POSIX shared memory; an
in-process engine can also read the trainer's own tensors). Oracle: after every push the engine's
parameters equal those of an engine that took the same tensors through the ordinary load path
(bit for bit), and its logits equal the trainer's. The layout is registered once (validated,
opened, planned), later pushes send its id only; a changed layout registers again, an unknown
id raises a typed error that the sender handles by registering again, bad layouts change nothing."""
from __future__ import annotations

import pytest
import torch

from rollout import Engine, EngineConfig, WeightUpdateError
from rollout.models.registry import model_class
from rollout.config import ModelConfig
from rollout.distributed import TPGroup
from rollout.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers import hf_model
from tests.test_weight_sync import BAD_UPDATES, PROMPTS, hf_logits, perturb
from weight_sync import WeightSender
from weight_sync.copy_plan import CopyPlan
from weight_sync.ipc_layout import IpcLayout, IpcLayoutRef, IpcLayoutUnknownError
from weight_sync.updater import WeightUpdater


@pytest.fixture()
def setup(tiny_dirs):
    path = tiny_dirs["Qwen2ForCausalLM"]
    cfg = EngineConfig(model_path=path, kv_cache_tokens=4096)
    return Engine(cfg), Engine(cfg), hf_model(path)


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}


def _assert_same_as_fresh_load(engine, oracle, trainer) -> None:
    """`oracle` takes the trainer's tensors through the ordinary (per-tensor) load path."""
    oracle.update_weights_from_tensor([(n, p.detach().clone()) for n, p in trainer.named_parameters()])
    got, want = _params(engine), _params(oracle)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in got)
    assert torch.equal(engine.prefill_logits(PROMPTS), oracle.prefill_logits(PROMPTS))
    assert (engine.prefill_logits(PROMPTS) - hf_logits(trainer)).abs().max() <= 1e-5


class _Spy:
    """Records what each update_weights_from_ipc call carried."""

    def __init__(self, engine):
        self.payloads = []
        inner = engine.update_weights_from_ipc

        def call(payload, **kw):
            self.payloads.append(type(payload).__name__)
            return inner(payload, **kw)
        engine.update_weights_from_ipc = call


@pytest.mark.parametrize("staging", [None, False], ids=["shm-staged", "direct-in-process"])
def test_registered_once_then_ids_only_and_equal_to_fresh_load(setup, staging):
    engine, oracle, trainer = setup
    spy = _Spy(engine)
    sender = WeightSender(engine, "ipc", bucket_bytes=64 << 10, ipc_staging=staging)
    for step in (1, 2, 3):
        perturb(trainer, seed=step)
        assert sender.push(trainer.named_parameters()) == step == engine.weight_version
        _assert_same_as_fresh_load(engine, oracle, trainer)
    assert spy.payloads == ["IpcLayout", "IpcLayoutRef", "IpcLayoutRef"]
    assert sender._ipc.registrations == 1 and engine.updater.incomplete_reason is None
    layout = engine.updater.ipc_layouts._layouts[engine.updater.ipc_layouts.ids()[0]]
    assert layout.opened.layout.buckets if staging is None else layout.opened.layout.tensors
    plan = layout.plan  # the load path was recorded: a few batched calls, not one per tensor
    assert plan is not None and plan.count == len(list(trainer.named_parameters()))
    assert plan.num_launches <= 2 < plan.num_copies
    sender.close()
    assert engine.updater.ipc_layouts.ids() == []  # the receiver unmapped the trainer's memory


def test_changed_layout_registers_again(setup):
    engine, oracle, trainer = setup
    spy = _Spy(engine)
    sender = WeightSender(engine, "ipc", ipc_staging=False)
    named = [(n, p.detach()) for n, p in trainer.named_parameters()]
    sender.push(named)
    first = engine.updater.ipc_layouts.ids()
    perturb(trainer, seed=4)
    sender.push(named)  # same tensors, new values: id only
    # one tensor reallocated (same name, shape, dtype; another address), another one strided
    named[0] = (named[0][0], named[0][1].clone())
    named[1] = (named[1][0], named[1][1].t().contiguous().t())
    sender.push(named)
    assert spy.payloads == ["IpcLayout", "IpcLayoutRef", "IpcLayout"]
    assert sender._ipc.registrations == 2
    assert len(engine.updater.ipc_layouts.ids()) == 1 and engine.updater.ipc_layouts.ids() != first
    _assert_same_as_fresh_load(engine, oracle, trainer)
    perturb(trainer, seed=5)  # writes in place into named[2:]; named[0:2] are the trainer's too now
    with torch.no_grad():
        for (n, t), p in zip(named[:2], trainer.parameters()):
            t.copy_(p)
    sender.push(named)
    assert spy.payloads[-1] == "IpcLayoutRef"
    _assert_same_as_fresh_load(engine, oracle, trainer)
    sender.close()


def test_staged_layout_changes_with_names_or_partial(setup):
    engine, oracle, trainer = setup
    sender = WeightSender(engine, "ipc", bucket_bytes=64 << 10)
    subset = [(n, p.detach()) for n, p in trainer.named_parameters() if ".layers.1." in n]
    perturb(trainer, seed=6)
    sender.push(subset, allow_partial=True)
    partial = sender._ipc.current.layout
    sender.push(trainer.named_parameters())  # the whole model: another layout, replacing it
    assert sender._ipc.registrations == 2 and engine.updater.ipc_layouts.ids() == [
        sender._ipc.current.layout.layout_id]
    _assert_same_as_fresh_load(engine, oracle, trainer)
    sender.close()
    # a layout registered as partial is never taken as a complete update
    other = WeightSender(engine, "ipc")
    other.push(subset, allow_partial=True)
    with pytest.raises(IpcLayoutUnknownError, match="partial"):
        engine.update_weights_from_ipc(other._ipc.current.layout.ref)
    with pytest.raises(IpcLayoutUnknownError):
        engine.update_weights_from_ipc(partial.ref, allow_partial=True)  # replaced: dropped
    other.close()


def test_unknown_layout_is_typed_and_sender_registers_again(setup):
    engine, oracle, trainer = setup
    before = _params(engine)
    with pytest.raises(IpcLayoutUnknownError, match="register it again"):
        engine.update_weights_from_ipc(IpcLayoutRef("no-such-layout"))
    assert isinstance(IpcLayoutUnknownError("x"), WeightUpdateError)
    assert engine.weight_version == 0 and engine.updater.incomplete_reason is None
    assert all(torch.equal(before[n], t) for n, t in _params(engine).items())
    spy = _Spy(engine)
    sender = WeightSender(engine, "ipc")
    sender.push(trainer.named_parameters())
    engine.drop_ipc_layouts()  # as a rebuilt shard: it never saw the layout
    perturb(trainer, seed=7)
    assert sender.push(trainer.named_parameters()) == 2 == engine.weight_version
    assert spy.payloads == ["IpcLayout", "IpcLayoutRef", "IpcLayout"]
    assert sender.last.extra.get("reregistered") == 1.0 and sender._ipc.registrations == 1
    _assert_same_as_fresh_load(engine, oracle, trainer)
    sender.close()


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_bad_layout_is_refused_at_registration(setup, case):
    engine, _, trainer = setup
    before = _params(engine)
    make_bad, message = BAD_UPDATES[case]
    sender = WeightSender(engine, "ipc", ipc_staging=False)
    weights = make_bad([(n, p.detach().clone()) for n, p in trainer.named_parameters()])
    for _ in range(2):  # not registered by the failed attempt: the next push is refused again
        with pytest.raises(WeightUpdateError, match=message):
            sender.push(weights)
    assert engine.updater.ipc_layouts.ids() == []
    assert engine.weight_version == 0 and engine.updater.incomplete_reason is None
    assert all(torch.equal(before[n], t) for n, t in _params(engine).items())
    sender.close()


def test_layouts_left_behind_by_a_refused_registration_are_dropped(setup):
    engine, oracle, trainer = setup
    sender = WeightSender(engine, "ipc", ipc_staging=False)
    good = [(n, p.detach()) for n, p in trainer.named_parameters()]
    sender.push(good)
    first = engine.updater.ipc_layouts.ids()
    with pytest.raises(WeightUpdateError, match="has shape"):
        sender.push(BAD_UPDATES["wrong shape"][0](good))
    assert engine.updater.ipc_layouts.ids() == first and engine.weight_version == 1
    perturb(trainer, seed=9)
    sender.push([(n, t.clone()) for n, t in good])  # lands: replaces both earlier layouts
    assert len(engine.updater.ipc_layouts.ids()) == 1 and engine.updater.ipc_layouts.ids() != first
    _assert_same_as_fresh_load(engine, oracle, trainer)
    sender.close()
    assert engine.updater.ipc_layouts.ids() == []


def test_layout_from_another_host_is_refused(setup):
    import dataclasses
    engine, _, trainer = setup
    sender = WeightSender(engine, "ipc")
    sender.push(trainer.named_parameters())
    forged = dataclasses.replace(sender._ipc.current.layout, layout_id="forged", host="another-boot-id")
    with pytest.raises(WeightUpdateError, match="another host"):
        engine.update_weights_from_ipc(forged)
    assert engine.weight_version == 1 and engine.updater.ipc_layouts.ids() != ["forged"]
    sender.close()


def test_released_weights_refuse_a_registered_push_then_resume(setup):
    engine, oracle, trainer = setup
    sender = WeightSender(engine, "ipc")
    sender.push(trainer.named_parameters())
    engine.release_memory(tags=("weights",))
    with pytest.raises(WeightUpdateError, match="released"):
        sender.push(trainer.named_parameters())
    engine.resume_memory(tags=("weights",))
    perturb(trainer, seed=8)
    sender.push(trainer.named_parameters())  # the cached plan writes into the restored storages
    assert engine.updater.incomplete_reason is None
    _assert_same_as_fresh_load(engine, oracle, trainer)
    sender.close()


def test_bucket_size_from_the_receivers_free_memory(setup):
    from weight_sync.bucket_size import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES, bucket_bytes_for
    assert bucket_bytes_for(None) == 512 << 20  # CPU: the default
    assert bucket_bytes_for(80 << 30) == MAX_BUCKET_BYTES == 1 << 30
    assert bucket_bytes_for(2 << 30) == 256 << 20
    assert bucket_bytes_for(100 << 20) == MIN_BUCKET_BYTES == 32 << 20
    engine, _, trainer = setup
    assert engine.weight_sync_free_bytes() is None  # a CPU engine
    engine.weight_sync_free_bytes = lambda: 3 << 30  # a fake GPU receiver with 3 GiB free
    for transport in ("tensor", "nccl", "ipc"):
        sender = WeightSender(engine, transport)
        sender.push(trainer.named_parameters())
        assert sender.bucket_bytes == sender.last.bucket_bytes == 384 << 20
        assert "free memory (3072 MiB)" in sender.bucket_source
        sender.close()
    sender = WeightSender(engine, "tensor", bucket_bytes=1 << 20)
    assert (sender.bucket_bytes, sender.bucket_source) == (1 << 20, "given")


# ---- the copy plan ---------------------------------------------------------------------------
class _Target:
    """A bare WeightTarget over a model shard (no engine): what a TP rank's updater drives."""

    def __init__(self, model):
        self.model, self.device = model, torch.device("cpu")

    def validate_weights(self, specs, error, *, complete=False, exact_dtype=True):
        self.model.weight_table.validate(specs, complete=complete, exact_dtype=exact_dtype, error=error)

    @torch.inference_mode()
    def load_weights(self, weights):
        return self.model.load_weights(weights)

    def weights_changed(self):
        self.model.packed_weights.clear()


def _shard(path, rank: int, size: int):
    cfg = ModelConfig.from_pretrained(path)
    model = model_class(cfg.architecture)(cfg, TPGroup(rank, size))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything the plan does not write shows up
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_shard_plan_copies_only_its_slice(tmp_path, rank):
    """vocab 509 over 2 ranks: rank 1 holds 254 rows + 1 padded row, zeroed by the loader."""
    path = str(make_tiny_model(tmp_path / "m", TinyModelSpec(vocab_size=509), with_tokenizer=False))
    trainer = hf_model(path)
    target, fresh = _Target(_shard(path, rank, 2)), _Target(_shard(path, rank, 2))
    updater = WeightUpdater(target)
    sender = WeightSender(_Adapter(updater), "ipc", bucket_bytes=64 << 10)
    for step in (1, 2):
        perturb(trainer, seed=step)
        sender.push(trainer.named_parameters())
        fresh.load_weights([(n, p.detach()) for n, p in trainer.named_parameters()])
        for (n, got), (_, want) in zip(target.model.named_parameters(), fresh.model.named_parameters()):
            assert torch.equal(got, want), n
    entry = updater.ipc_layouts._layouts[updater.ipc_layouts.ids()[0]]
    assert entry.plan is not None and len(entry.plan.fixups) == 2 * rank  # padded rows
    sources = {t.untyped_storage().data_ptr() for _, t in entry.opened.named()}
    pairs = [p for d, s in entry.plan.groups for p in zip(d, s)] + entry.plan.direct
    shard_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    assert all(s.untyped_storage().data_ptr() in sources for _, s in pairs)  # views, no copies
    assert sum(d.numel() * d.element_size() for d, _ in pairs) < 0.6 * sender.last.nbytes
    assert sum(d.numel() * d.element_size() for d, _ in pairs) <= shard_bytes
    sender.close()


class _Adapter:
    """The Engine's weight API over a bare updater (what a TP follower shard exposes)."""

    def __init__(self, updater):
        self.updater, self.weight_version = updater, 0

    def update_weights_from_ipc(self, payload, *, version, allow_partial=False, pause_mode=None):
        self.updater.precheck("ipc", payload)
        self.updater.from_ipc(payload, allow_partial)
        self.weight_version = version
        return version

    def drop_ipc_layouts(self, ids=None):
        self.updater.ipc_layouts.drop(ids)


def test_unplannable_load_path_falls_back_to_plain_loading():
    src = torch.arange(6.0)
    dst = torch.zeros(6)

    def computed(weights):  # a loader that transforms: cannot be replayed as copies
        for _, t in weights:
            dst.copy_(t * 2)
        return 1

    def plain(weights):
        for _, t in weights:
            dst[:3].copy_(t[3:])
            dst[3:].zero_()
        return 1

    def overlapping(weights):  # a fix-up on memory a copy writes: order would matter
        for _, t in weights:
            dst.zero_()
            dst.copy_(t)
        return 1

    assert CopyPlan.record(computed, [("x", src)]) is None
    assert CopyPlan.record(overlapping, [("x", src)]) is None
    dst.fill_(7.0)
    plan = CopyPlan.record(plain, [("x", src)])
    assert torch.equal(dst, torch.full((6,), 7.0))  # recording writes nothing
    assert plan.run() == 1 and dst.tolist() == [3.0, 4.0, 5.0, 0.0, 0.0, 0.0]
    src += 1  # the plan reads the source's memory at run time
    plan.run()
    assert dst.tolist() == [4.0, 5.0, 6.0, 0.0, 0.0, 0.0]


def test_large_tensors_copy_directly_small_ones_batched():
    srcs = [("big", torch.randn(1 << 20)), ("a", torch.randn(10)), ("b", torch.randn(3, 4))]
    dsts = {n: torch.zeros_like(t) for n, t in srcs}

    def load(weights):
        for n, t in weights:
            dsts[n].copy_(t)
        return len(weights)

    plan = CopyPlan.record(load, srcs, direct_bytes=1 << 20)
    assert len(plan.direct) == 1 and plan.num_copies == 3 and plan.num_launches == 2
    plan.run()
    assert all(torch.equal(dsts[n], t) for n, t in srcs)


def test_layout_message_is_small():
    import pickle
    ref = IpcLayoutRef("0" * 32)
    assert len(pickle.dumps(ref)) < 200
    assert isinstance(IpcLayout("x", "h", 1, ()).ref, IpcLayoutRef)
