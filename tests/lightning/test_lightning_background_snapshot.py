"""``background_snapshot: true`` in a Trainer fit: the parameters and optimizer state are copied by
the save's thread while the next step's forward and backward run, the strategy waits for the copy
before the optimizer step and at hooks outside the steps (a weight swap at validation), every
checkpoint holds the state as of its save, and a change made too early fails the save, naming it.
The background copy is held by a gate (an event) opened from another thread, never by the clock."""

import threading

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ConfigError, SaveFailedError
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_distckpt.lightning.snapshot_fence import SnapshotFence
from lightning_distckpt.saving import background_snapshot
from lightning_helpers import TPMLP, quiet_trainer

CONFIG = {"async_save": True, "background_snapshot": True}


class GateEveryCopy:
    """Each background copy waits until the gate opens (then it closes again for the next copy).
    ``open_on_reach()``: a helper thread opens it as soon as a copy waits, for where the training
    thread itself is held until the copy is done (the fence)."""

    def __init__(self, monkeypatch):
        self.open, self.reached = threading.Event(), threading.Event()
        self.copies, self._stop = 0, False
        real = background_snapshot.copy_in

        def gated(placed, ready=None):
            self.copies += 1
            self.reached.set()
            assert self.open.wait(60), "nobody opened the gate"
            self.open.clear()
            real(placed, ready)

        monkeypatch.setattr(background_snapshot, "copy_in", gated)

    def open_on_reach(self):
        def helper():
            while self.reached.wait() and not self._stop:
                self.reached.clear()
                self.open.set()
        threading.Thread(target=helper, daemon=True).start()

    def stop(self):
        self._stop = True
        self.reached.set()


class Expect(Callback):
    """Records each checkpoint's tensors as Lightning builds the dict (the values the save must hold);
    at the next step's start, sees the copy still pending; lets it go when the strategy waits for it."""

    def __init__(self, gate):
        self.gate, self.saved, self.pending_at_next_step = gate, {}, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        moments = [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                   for s in trainer.optimizers[0].state.values()]
        self.saved[trainer.global_step] = (params, moments)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pending = trainer.strategy.checkpoint_io.pending
        if pending is not None and not pending.snapshot_done():
            self.pending_at_next_step += 1

    def on_after_backward(self, trainer, pl_module):
        """After the forward and backward, the copy is let go only once the strategy waits for it
        (before the optimizer step, which would change what is being copied)."""
        pending = trainer.strategy.checkpoint_io.pending
        if pending is not None and not pending.snapshot_done():
            wait, gate = pending.wait_snapshot, self.gate

            def let_go_and_wait():
                gate.open.set()
                wait()

            pending.wait_snapshot = let_go_and_wait



def test_checkpoints_hold_the_state_as_of_their_save(tmp_path, isolated_process_group, monkeypatch):
    gate = GateEveryCopy(monkeypatch)
    expect = Expect(gate)
    strategy = DistCheckpointStrategy(checkpoint=CONFIG)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(strategy=strategy, max_steps=9, callbacks=[expect, ckpt])
    trainer.fit(TPMLP(total_steps=9))
    assert isinstance(trainer.callbacks[0], SnapshotFence)
    assert gate.copies == len(expect.saved) == 4
    assert expect.pending_at_next_step == 4  # each copy was still to be taken as the next step began
    assert strategy.snapshot_wait_s > 0  # the step waited for it (the copy went only once it did)
    for step, (params, moments) in expect.saved.items():
        loaded = strategy.checkpoint_io.load_checkpoint(tmp_path / f"step={step}.ckpt")
        for k, v in params.items():
            assert torch.equal(loaded["state_dict"][k], v), (step, k)
        stored = loaded["optimizer_states"][0]["state"]
        for i, m in enumerate(moments):
            for k, v in m.items():
                assert torch.equal(stored[i][k], v), (step, i, k)


class SwapAtValidation(Callback):
    """Swaps fc1's weights in place through ``.data`` (as weight-averaging callbacks do), which torch's
    version counters do not see: only waiting for the copy first keeps the checkpoint right."""

    def on_validation_epoch_start(self, trainer, pl_module):
        pl_module.fc1.weight.data.mul_(-1.0)

    def on_validation_epoch_end(self, trainer, pl_module):
        pl_module.fc1.weight.data.mul_(-1.0)


class WithValidation(TPMLP):
    def validation_step(self, batch, batch_idx):
        return None

    def val_dataloader(self):
        return self.train_dataloader()


def test_hooks_outside_the_steps_wait_for_the_copy(tmp_path, isolated_process_group, monkeypatch):
    gate = GateEveryCopy(monkeypatch)
    gate.open_on_reach()  # validation follows a save at once: the fence holds the training thread there
    expect = Expect(gate)
    strategy = DistCheckpointStrategy(checkpoint=CONFIG)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(strategy=strategy, max_steps=4, val_check_interval=2, num_sanity_val_steps=0,
                            limit_val_batches=1, callbacks=[SwapAtValidation(), expect, ckpt])
    try:
        trainer.fit(WithValidation(total_steps=4))
    finally:
        gate.stop()
    assert gate.copies == len(expect.saved) == 2
    for step, (params, _) in expect.saved.items():
        loaded = strategy.checkpoint_io.load_checkpoint(tmp_path / f"step={step}.ckpt")
        assert torch.equal(loaded["state_dict"]["fc1.weight"], params["fc1.weight"]), step


class BreaksThePromise(Callback):
    """Changes a parameter in place at the next step's start, before the held copy was taken."""

    def __init__(self, gate):
        self.gate = gate

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pending = trainer.strategy.checkpoint_io.pending
        if pending is not None and not pending.snapshot_done():
            with torch.no_grad():
                pl_module.fc2.weight.add_(1.0)
            self.gate.open.set()


def test_a_change_before_the_copy_fails_the_save_naming_it(tmp_path, isolated_process_group, monkeypatch):
    gate = GateEveryCopy(monkeypatch)
    strategy = DistCheckpointStrategy(checkpoint=CONFIG)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(strategy=strategy, max_steps=4, callbacks=[BreaksThePromise(gate), ckpt])
    with pytest.raises(SaveFailedError, match=r"changed in place while the background snapshot copied them: 'fc2.weight'"):
        trainer.fit(TPMLP(total_steps=4))
    assert not (tmp_path / "step=2.ckpt").exists()


def test_background_snapshot_needs_async_save():
    with pytest.raises(ConfigError, match="needs async_save"):
        DistCheckpointStrategy(checkpoint={"background_snapshot": True})
    assert ldc  # the package imports with the option


def test_the_plugin_alone_says_it_copies_before_returning(tmp_path, caplog):
    """A stock strategy has no step the plugin could wait at: the option is said to have no effect there,
    once, and the checkpoints hold the state as of their save."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distckpt.lightning import DistCheckpointIO

    io = DistCheckpointIO(CONFIG)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(plugins=[io], max_steps=2, callbacks=[ckpt])
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        trainer.fit(BoringModel())
    told = [m for m in caplog.messages if "background_snapshot" in m]
    assert len(told) == 1 and "copies before returning" in told[0]
    assert io.load_checkpoint(tmp_path / "step=2.ckpt")["global_step"] == 2


def test_fabric_waits_before_the_next_optimizer_step(tmp_path, isolated_process_group, monkeypatch):
    """Fabric: the copy overlaps the caller's forward and backward; ``optimizer.step()`` waits for it;
    the checkpoint holds the weights and moments as of ``fabric.save``."""
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    gate = GateEveryCopy(monkeypatch)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy(checkpoint=CONFIG))
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(8, 4))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))
    for _ in range(2):
        fabric.backward(model(torch.randn(4, 8)).sum())
        opt.step()
    saved = ({k: v.detach().clone() for k, v in model.state_dict().items()},
             opt.state[model.weight]["exp_avg"].clone())
    fabric.save(tmp_path / "ck", {"model": model, "optimizer": opt, "step": 2})
    pending = fabric.strategy.checkpoint_io.pending
    assert gate.reached.wait(60) and not pending.snapshot_done()
    fabric.backward(model(torch.randn(4, 8)).sum())  # overlaps the copy
    wait = pending.wait_snapshot

    def let_go_and_wait():  # the copy goes only once the strategy waits for it
        gate.open.set()
        wait()

    pending.wait_snapshot = let_go_and_wait
    opt.step()  # waits for the copy first
    gate.open.set()  # (without that wait, the copy would now see the stepped weights and fail the save)
    assert pending.snapshot_done()
    model2 = fabric.setup(torch.nn.Linear(8, 4))
    opt2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=0.1))
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric.load(tmp_path / "ck", state)  # finalizes the save first
    assert state["step"] == 2 and all(torch.equal(model2.state_dict()[k], v) for k, v in saved[0].items())
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], saved[1])
