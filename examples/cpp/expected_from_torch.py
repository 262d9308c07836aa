"""Prints the torch.optim.Adam reference values that examples/cpp/adam_matches_torch.cpp checks.

The C++ program rebuilds the same inputs from the same formulas (p0[i] = sin(i + 1),
grad_s[i] = cos(0.7 * i + s), computed in double and rounded to float32), so the stored values
are an independent reference: they come from torch, not from RoundPipe.
"""

import math

import torch

N, STEPS = 19, 5
p = torch.nn.Parameter(torch.tensor([math.sin(i + 1) for i in range(N)], dtype=torch.float32))
opt = torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01,
                       amsgrad=True, foreach=False)
for s in range(STEPS):
    p.grad = torch.tensor([math.cos(0.7 * i + s) for i in range(N)], dtype=torch.float32)
    opt.step()
print(",\n".join(f"    {v!r}f" for v in p.detach().tolist()))
