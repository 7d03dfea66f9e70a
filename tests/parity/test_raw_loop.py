"""saferun's Trainer computes exactly what a hand-written PyTorch loop computes."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from toys import Net, ToyTrainer, make_classification, toy_config, weights

STEPS = 24  # three epochs of 8 batches


def hand_written_loop(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Net()
    x, y = make_classification(256 + 64)
    loader = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=32, shuffle=False,
                        generator=torch.Generator())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model.train()
    step = 0
    while step < STEPS:
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step == STEPS:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class NoValidation(ToyTrainer):
    def build_datasets(self):
        train, _ = super().build_datasets()
        return train, None


def test_weights_are_bitwise_equal_to_a_hand_written_loop(tmp_path):
    cfg = toy_config(tmp_path, max_steps=STEPS, shuffle=False, max_grad_norm=1.0, log_every_n_steps=5)
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.1}
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 5, "gamma": 0.5}
    cfg["seed"] = 3
    t = NoValidation(cfg)
    t.fit()
    expected = hand_written_loop(seed=3)
    got = weights(t)
    assert list(got) == list(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
