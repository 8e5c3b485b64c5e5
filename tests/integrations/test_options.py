"""The integrations' early errors, strategy names, config files, stats callback and optimizer
pairing — in-process, except the pairing on a 2-rank gloo group (spawned, with a timeout)."""

import logging
import types
import warnings

import pytest
import torch

from comms.cluster.launch import spawn

L = pytest.importorskip("lightning")

from comms.integrations import accelerate as acc_helper  # noqa: E402
from comms.integrations import fabric as fabric_helper  # noqa: E402
from comms.integrations.callback import CommpressStatsCallback  # noqa: E402
from comms.integrations.lightning import SPEC_ENV, CommpressDDPStrategy  # noqa: E402
from comms.integrations.pairing import REGISTER_OPTIONS, check_options, summary  # noqa: E402

TOPK = "topk:density=0.01"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(compressor=TOPK, algorithm="two-phase"), ValueError, "unknown algorithm 'two-phase'"),
    (dict(compressor=TOPK, algorithm="allreduce"), ValueError, "needs the 'allreduce' family"),
    (dict(compressor="topk:dens=0.01"), ValueError, "dens"),
    (dict(compressor="nope"), ValueError, "unknown compressor 'nope'"),
    (dict(compressor=TOPK, momentum="0.9"), TypeError, "momentum must be a number"),
    (dict(compressor=TOPK, momentum=1.5), ValueError, "momentum must be in"),
    (dict(compressor=TOPK, clip_norm=-1.0), ValueError, "clip_norm"),
    (dict(compressor=TOPK, warmup_steps=-1), ValueError, "warmup_steps"),
    (dict(compressor=TOPK, start_iter=1.5), TypeError, "start_iter"),
    (dict(compressor=TOPK, commpress_timeout="soon"), ValueError, "timeout"),
    (dict(compressor=TOPK, check_replicas_every=True), TypeError, "check_replicas_every"),
    (dict(compressor=TOPK, adam_freeze=0), ValueError, "adam_freeze must be 'auto', an int >= 1"),
    (dict(compressor=TOPK, sync_fragments=2), ValueError, r"\['sync_fragments'\] configure the outer sync"),
    (dict(compressor=TOPK, sync_every=4, sync_delay=4), ValueError, "sync_delay must be < sync_every"),
    (dict(compressor=TOPK, sync_every=4, clip_norm=1.0), ValueError, r"\['clip_norm'\] configure per-step"),
    (dict(compressor=TOPK, momentun=0.9), TypeError, r"unknown argument\(s\) \['momentun'\]"),
    (dict(compressor=TOPK, ddp_comm_hook=print), ValueError, "ddp_comm_hook is not allowed"),
])
def test_strategy_refuses_bad_input_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        CommpressDDPStrategy(**kwargs)


def test_strategy_takes_every_register_option_and_keeps_ddp_kwargs_apart():
    s = CommpressDDPStrategy(TOPK, algorithm="allgather", momentum=0.9, clip_norm=2.0,
                             warmup_steps=0, commpress_timeout=30, check_replicas_every=10,
                             adam_freeze=20, find_unused_parameters=True)
    assert set(s.commpress_options) == set(REGISTER_OPTIONS)
    assert "adam_freeze" in REGISTER_OPTIONS and s.commpress_options["adam_freeze"] == 20
    assert CommpressDDPStrategy(TOPK, sync_every=8, outer="average")._commpress_given == \
        {"sync_every": 8, "outer": "average"}  # only what differs from register's defaults
    assert s.commpress_options["momentum"] == 0.9 and s.commpress_options["timeout"] == 30
    assert s._ddp_kwargs == {"find_unused_parameters": True}  # momentum no longer reaches DDP


def test_spec_from_environment_and_strategy_name(monkeypatch):
    monkeypatch.delenv(SPEC_ENV, raising=False)
    with pytest.raises(ValueError, match=SPEC_ENV):
        CommpressDDPStrategy()
    monkeypatch.setenv(SPEC_ENV, "qsgd:bits=4")
    trainer = L.Trainer(strategy="commpress_ddp", accelerator="cpu", devices=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, CommpressDDPStrategy)
    assert trainer.strategy.commpress_compressor.spec().startswith("qsgd:bits=4")
    assert trainer.strategy._start_method == "popen"


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


def test_strategy_from_lightning_cli_yaml_and_arguments(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    cfg = tmp_path / "config.yaml"
    cfg.write_text("trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
                   "    class_path: comms.integrations.lightning.CommpressDDPStrategy\n"
                   "    init_args:\n      compressor: topk:density=0.01\n      algorithm: allgather\n"
                   "      momentum_masking: sent\n      process_group_backend: gloo\n")
    cli = LightningCLI(_Tiny, run=False, args=["--config", str(cfg)], save_config_callback=None)
    s = cli.trainer.strategy
    assert isinstance(s, CommpressDDPStrategy) and s.process_group_backend == "gloo"
    assert s.commpress_options["algorithm"] == "allgather"
    assert s.commpress_options["momentum_masking"] == "sent"
    monkeypatch.setenv(SPEC_ENV, "sign")
    cli = LightningCLI(_Tiny, run=False, save_config_callback=None,
                       args=["--trainer.strategy=commpress_ddp", "--trainer.accelerator=cpu",
                             "--trainer.devices=2", "--trainer.logger=false"])
    assert cli.trainer.strategy.commpress_compressor.spec().startswith("sign")


class _Tuner:
    locked, decision, tuning_steps, tuning_cost_s, tunings = True, "allgather", 12, 0.25, 1


class _State:
    iter, algorithm = 40, "auto"
    planner = types.SimpleNamespace(tuner=_Tuner())

    def wire_bytes_per_step(self):
        return 100

    def dense_bytes_per_step(self):
        return 1000


def test_stats_callback_logs_bytes_ratio_and_locked_plan(caplog):
    logged, hparams = {}, {}
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(commpress_state=_State()),
                                    is_global_zero=True, global_step=4,
                                    logger=types.SimpleNamespace(log_hyperparams=hparams.update))
    module = types.SimpleNamespace(log_dict=lambda m, **kw: logged.update(m, kw=kw))
    cb = CommpressStatsCallback()
    with caplog.at_level(logging.INFO, logger="comms.integrations.callback"):
        cb.on_train_batch_end(trainer, module, None, None, 0)
        cb.on_train_batch_end(trainer, module, None, None, 1)
    assert logged["commpress/wire_bytes"] == 100.0 and logged["commpress/dense_bytes"] == 1000.0
    assert logged["commpress/ratio"] == 10.0 and logged["commpress/tuning_steps"] == 12.0
    assert logged["commpress/locked"] == 1.0 and logged["commpress/plan_compressed"] == 1.0
    assert logged["kw"]["rank_zero_only"] is True
    assert hparams == {"commpress_plan": "allgather", "commpress_tuning_steps": 12}
    locks = [r for r in caplog.records if "autotune locked 'allgather'" in r.getMessage()]
    assert len(locks) == 1  # once per lock, not per step
    assert summary(_State())["plan"] == "allgather"
    with pytest.raises(ValueError, match="logging_interval"):
        CommpressStatsCallback(logging_interval=0)


def test_helpers_warn_on_one_process_and_name_the_fix_otherwise():
    net = torch.nn.Linear(2, 1)
    one = types.SimpleNamespace(num_processes=1, world_size=1, strategy=object())
    for call in (lambda: acc_helper.register(one, net, TOPK),
                 lambda: fabric_helper.register(one, net, TOPK)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert call() is None
        assert any("one process" in str(x.message) for x in w)
    with pytest.raises(ValueError, match="unknown algorithm 'two-phase'"):
        acc_helper.register(one, net, TOPK, algorithm="two-phase")  # checked on one process too
    for helper in (acc_helper, fabric_helper):  # every register option, adam_freeze included
        with pytest.warns(UserWarning, match="one process"):
            assert helper.register(one, net, TOPK, adam_freeze=5, check_replicas_every=3) is None
        with pytest.raises(ValueError, match="adam_freeze"):
            helper.register(one, net, TOPK, adam_freeze="soon")
    with pytest.raises(TypeError, match="momentum must be a number"):
        fabric_helper.register(one, net, TOPK, momentum="high")
    two = types.SimpleNamespace(num_processes=2, world_size=2, strategy=types.SimpleNamespace())
    with pytest.raises(TypeError, match="strategy='ddp'"):
        fabric_helper.register(two, net, TOPK)
    with pytest.raises(TypeError, match="fsdp_version=2"):
        acc_helper.register(two, net, TOPK)


def test_check_options_names_unknown_options():
    with pytest.raises(TypeError, match=r"unknown commpress option\(s\) \['bogus'\]"):
        check_options(TOPK, {"bogus": 1})
    assert check_options(TOPK, {"algorithm": "allgather"}).algorithm == "allgather"


def _pairing(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from comms.integrations.pairing import register_paired

    def model_and(*momenta, **extra):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=mo, **extra)
                for m, mo in zip(net, momenta)]
        return DDP(net), opts

    out = {}
    ddp, opts = model_and(0.9, 0.9)
    st = register_paired(ddp, TOPK, opts, algorithm="allgather")
    out["same"] = [st.momentum] + [o.param_groups[0]["momentum"] for o in opts]
    for name, (momenta, extra) in {"different": ((0.9, 0.5), {}),
                                   "nesterov": ((0.9, 0.9), {"nesterov": True})}.items():
        ddp, opts = model_and(*momenta, **extra)
        try:
            register_paired(ddp, TOPK, opts, algorithm="allgather")
            out[name] = None
        except ValueError as exc:
            out[name] = (str(exc), [o.param_groups[0]["momentum"] for o in opts])
    ddp, opts = model_and(0.0, 0.0)
    out["adam"] = register_paired(ddp, "sign", [torch.optim.Adam(ddp.parameters())]).momentum
    out["fsdp2"] = _fsdp2_route(world)
    return out


def _fsdp2_route(world):
    """Accelerate's helper sends a fully_shard model to comms.fsdp.register; one step runs."""
    from torch.distributed.fsdp import fully_shard

    from comms.fsdp import FSDPCompressionState

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    accelerator = types.SimpleNamespace(num_processes=world)
    state = acc_helper.register(accelerator, net, "sign", optimizer=opt, checkpoint=False)
    net(torch.ones(4, 8)).sum().backward()
    opt.step()
    return type(state) is FSDPCompressionState


@pytest.mark.dist
def test_register_paired_takes_one_shared_momentum_or_refuses():
    for r in spawn(_pairing, 2, timeout=120):
        assert r["same"] == [0.9, 0.0, 0.0]
        msg, momenta = r["different"]
        assert "one momentum to every gradient bucket" in msg and momenta == [0.9, 0.5]
        msg, momenta = r["nesterov"]
        assert "nesterov=True" in msg and momenta == [0.9, 0.9]  # nothing changed
        assert r["adam"] is None
        assert r["fsdp2"]


class _SpawnNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_spawn_launch_brings_rank0_stats_to_the_parent():
    strategy = CommpressDDPStrategy("sign", algorithm="allgather", start_iter=1,
                                    start_method="spawn", process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(_SpawnNet())
    assert strategy.commpress_state is None  # the ranks were child processes
    stats = strategy.commpress_stats
    assert stats["iter"] == 3 and stats["algorithm"] == "allgather"
    assert stats["wire_bytes"] < stats["dense_bytes"]
    assert "compressor=sign" in strategy.commpress_report
