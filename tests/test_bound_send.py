"""A bucket record's bound send (:class:`geofp8.comm.plan.BoundSend`: the FP8 stages' send
with the bucket's vector and residual bound once) against the stages' own send, bit for bit,
under Triton's interpreter (in a child: the interpreter must be on before the kernels are
decorated): the send buffer and the residual written, FP32 and BF16 residuals, ``keep``
true, false and ``None``, NaN and ±Inf in the gradient and the residual, N = 1, 3, 4, several
calls of one binding (a residual rewritten in place, as a record's is every step); and
without a residual, no error kept (the bucket not written)."""

import pytest

from interpreted import Child


def check() -> list[str]:
    import torch

    from geofp8.codecs import make_codec
    from geofp8.comm import ShardLayout

    failures = []
    shapes = [(3, 300), (5,), (64, 40)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    for n, dtype, keep in [(n, d, k) for n in (1, 3, 4) for d in (torch.float32, torch.bfloat16)
                           for k in (True, False, None)]:
        layout = ShardLayout.build(shapes, make_codec("e4m3", "row"), n, kernels="batched")
        gen = torch.Generator().manual_seed(n)
        residual = (torch.randn(numel, generator=gen) * 1e-2).to(dtype)
        residual[7], residual[11] = float("nan"), float("-inf")
        flat, r = torch.randn(numel, generator=gen), residual.clone()
        flat[3], flat[5] = float("inf"), float("nan")
        stages = layout.plan.bound(flat, flat)
        bound = stages.sender(flat.clone(), residual)
        flag = None if keep is None else torch.tensor(keep)
        for call in range(2):  # the same binding twice: R read and rewritten in place
            want = stages.send(flat, None, (r, flag), None, n - 1)
            got = bound((residual, flag), None, n - 1)
            name = f"N={n} {dtype} keep={keep} call {call}"
            if not torch.equal(got, want):
                failures.append(f"{name}: sent")
            if not torch.equal(residual.view(torch.uint8), r.view(torch.uint8)):
                failures.append(f"{name}: residual")
        plain = flat.clone()
        want = stages.send(flat, None, None, None, 0)
        if not (torch.equal(stages.sender(plain, None)(None, None, 0), want)
                and torch.equal(plain.view(torch.int32), flat.view(torch.int32))):
            failures.append(f"N={n}: without a residual")
    return failures


CHILD = Child([__file__])  # this file run as a script: the check above


@pytest.mark.child(CHILD)
def test_a_records_bound_send_writes_the_stages_sends_bits_under_the_interpreter():
    lines = CHILD.lines()
    assert lines == ["ok"], "\n".join(lines)[-3000:]


if __name__ == "__main__":
    print("\n".join(check()) or "ok")
