"""Checkpoint content proven on a real single-rank gloo group and Megatron's distributed
checkpointing: each checkpoint records a fingerprint of every tensor handed to the writer, consecutive checkpoints
of changing weights record (and load) those weights, and a checkpoint whose tensor bytes were altered on disk is
refused naming the data file."""

import json

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_pacs.mcore.checkpoint_fingerprint import CheckpointContentError, read_fingerprints
from megatron_pacs.mcore.training_checkpoint import load_training_checkpoint, save_training_checkpoint

pytestmark = pytest.mark.usefixtures("single_rank_gloo")


class TwoTensors(torch.nn.Module):
    """What a model gives a save (its sharded state dict): two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 64).reshape(8, 8))
        self.bias = torch.nn.Parameter(torch.full((8,), 0.25))

    def sharded_state_dict(self):
        return {
            "weight": ShardedTensor.from_rank_offsets("weight", self.weight.detach(), replica_id=0),
            "bias": ShardedTensor.from_rank_offsets("bias", self.bias.detach(), replica_id=0),
        }


def _save(root, step, model, parent=None):
    return save_training_checkpoint(root, step, [model], None, {"step": step}, parent=parent, keep_last=3)


def test_consecutive_checkpoints_record_and_load_the_weights_of_their_step(tmp_path):
    """Two saves of weights changed between them: every tensor's recorded fingerprint differs, each equals the
    live weights' at its step, and each checkpoint loads back exactly those weights (its content checked)."""
    model = TwoTensors()
    live = {}
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5).add_(0.1 * step)
        live[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _save(tmp_path, step, model, parent=tmp_path / "iter_0000001" if step == 2 else None)
    recorded = {step: read_fingerprints(tmp_path / f"iter_{step:07d}")[0] for step in (1, 2)}
    for key in ("weight", "bias"):
        assert recorded[1][key] != recorded[2][key], key
        for step in (1, 2):
            t = live[step][key].double()
            assert recorded[step][key] == pytest.approx([t.numel(), t.sum().item(), (t * t).sum().item()])
    for step in (1, 2):
        fresh = TwoTensors()
        load_training_checkpoint(tmp_path / f"iter_{step:07d}", [fresh], None)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, live[step][key]), (step, key)


def test_a_checkpoint_whose_tensor_changed_on_disk_is_refused_naming_the_file(tmp_path):
    """One value of ``bias`` rewritten in the data file (a bad disk, a stale buffer written): the load is refused
    naming the ``.distcp`` file and the tensor, not resumed with other weights."""
    model = TwoTensors()
    ckpt = _save(tmp_path, 1, model)
    needle = model.bias.detach().numpy().tobytes()
    (data,) = [p for p in ckpt.glob("*.distcp") if needle in p.read_bytes()]
    blob = data.read_bytes()
    data.write_bytes(blob.replace(needle, torch.full((8,), 0.5).numpy().tobytes()[:4] + needle[4:]))
    with pytest.raises(CheckpointContentError, match=rf"--load: {data}.* does not hold what was saved.*bias"):
        load_training_checkpoint(ckpt, [TwoTensors()], None)


def test_an_unreadable_fingerprint_is_refused_naming_it(tmp_path):
    ckpt = _save(tmp_path, 1, TwoTensors())
    (fp,) = ckpt.glob("fingerprint_rank*.json")
    fp.write_text("{")
    with pytest.raises(CheckpointContentError, match=rf"{fp} is unreadable"):
        load_training_checkpoint(ckpt, [TwoTensors()], None)
    fp.write_text(json.dumps({"weight": [64, 0.0, 0.0], "bias": [8, 2.0, 0.5]}))  # bias right, weight wrong
    with pytest.raises(CheckpointContentError, match=r"weight: sum"):
        load_training_checkpoint(ckpt, [TwoTensors()], None)
