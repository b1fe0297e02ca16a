"""The fresh optimizer state a restore's template is built from, large and small, is exactly what a
zero-gradient step makes, and evolves the same way."""

import pytest
import torch

from lightning_distckpt.optim.sharded_optimizer import _init_state_by_step, init_optimizer_state

_LARGE_BYTES = 1 << 20  # 1 MiB and more: states once made from calloc (tests/trust/test_trust_optimizer_redteam.py)


def _large(dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(0)
    rows = _LARGE_BYTES // (256 * torch.empty((), dtype=dtype).element_size()) + 3  # just over the threshold
    return [torch.nn.Parameter(torch.randn(rows, 256, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(7, 5, generator=g).to(dtype)),  # small: torch.zeros_like
            torch.nn.Parameter(torch.randn(256, rows, generator=g).to(dtype).t())]  # not contiguous: zeros_like


def _state(opt: torch.optim.Optimizer) -> list:
    return [{k: (v.dtype, tuple(v.shape), v.stride(), v.clone()) if isinstance(v, torch.Tensor) else v
             for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def _same(a: list, b: list) -> bool:
    return all(x.keys() == y.keys() and all(
        (x[k][:3] == y[k][:3] and torch.equal(x[k][3], y[k][3])) if isinstance(x[k], tuple) else x[k] == y[k]
        for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_large_fresh_state_is_zeros_and_steps_alike(dtype, make):
    direct_params, stepped_params = _large(dtype), _large(dtype)
    direct, stepped = make(direct_params), make(stepped_params)
    init_optimizer_state(direct)
    _init_state_by_step(stepped, list(stepped_params))
    big = next(v for v in direct.state[direct_params[0]].values() if v.dim() > 0)
    assert big.numel() * big.element_size() >= _LARGE_BYTES and not big.any()
    assert _same(_state(direct), _state(stepped))
    for params, opt in ((direct_params, direct), (stepped_params, stepped)):
        for _ in range(2):
            opt.zero_grad()
            sum((p.float() * p.float()).sum() for p in params).backward()
            opt.step()
    assert _same(_state(direct), _state(stepped))
    assert all(torch.equal(a, b) for a, b in zip(direct_params, stepped_params))
    # the optimizer's own round trip (what a restore ends with) keeps the state
    sd = direct.state_dict()
    direct.load_state_dict(sd)
    assert _same(_state(direct), _state(stepped))
