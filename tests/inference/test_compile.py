"""QuantizedLinear under torch.compile: `quantized_matmul` becomes one custom operator
(`torch.ops.lightspeed.quantized_matmul`, the Note in lightspeed/ops/wquant/__init__.py) so dynamo
traces a model of quantized layers in one graph, and the compiled model computes what the eager one
does (CPU: the reference; CUDA: the Triton kernel, inductor, and a CUDA graph of the compiled step).
The operator's backward: x and bias get F.linear's gradients with the dequantized weight, eager and
compiled, on CPU and CUDA."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightspeed.inference import QuantizedLinear
from lightspeed.ops.wquant import quantize

CASES = [("fp6", None), ("int8", None), ("int4", None), ("int4", 32), ("int8", 64)]
OP = torch.ops.lightspeed.quantized_matmul.default


class _MLP(nn.Module):
    def __init__(self, fmt, group_size, dtype, device, k=192, hidden=160, n=72):
        super().__init__()
        torch.manual_seed(0)
        up, down = nn.Linear(k, hidden).to(device, dtype), nn.Linear(hidden, n, bias=False).to(device, dtype)
        self.up = QuantizedLinear.from_linear(up, weight=fmt, group_size=group_size)
        self.down = QuantizedLinear.from_linear(down, weight=fmt, group_size=group_size and 32)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def _targets(gm):
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("fmt,group_size", CASES)
def test_quantized_layers_compile_to_one_graph(fmt, group_size):
    """fullgraph=True (no graph break), each layer one operator node, outputs equal to eager for several
    M (a static then a dynamic-shape graph) and leading dims, and no recompile for a repeated shape."""
    model = _MLP(fmt, group_size, torch.float32, "cpu")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 192), (2, 5, 192), (1, 192), (17, 192), (30, 192)]
    with torch.no_grad():
        for rep in range(2):
            for shape in shapes:
                x = torch.randn(*shape, generator=gen)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            if rep == 0:
                first = len(graphs)
    # (3, K) static, 3-D, M = 1 (specialized), then one dynamic-M graph; the second round compiles nothing
    assert 1 <= first <= 4 and len(graphs) == first
    for gm in graphs:
        assert sum(t in (OP, OP.overloadpacket) for t in _targets(gm)) == 2


@pytest.mark.parametrize("fmt,group_size", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_operator_passes_opcheck(fmt, group_size, bias):
    """torch.library.opcheck: schema, fake (meta) implementation against the real one, autograd
    registration and AOT dispatch."""
    gen = torch.Generator().manual_seed(2)
    n, k = 40, 192
    qw = quantize(torch.randn(n, k, generator=gen), fmt, group_size)
    x = torch.randn(2, 3, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    args = (x, list(qw.planes), qw.scales, b, qw.format, n, k, qw.group_size, qw.dtype, qw.tile)
    torch.library.opcheck(OP, args)
    torch.testing.assert_close(OP(*args), nn.functional.linear(x, qw_dequant(qw), b))
    grad_args = (x.clone().requires_grad_(True), *args[1:3], None if b is None else b.clone().requires_grad_(True),
                 *args[4:])
    torch.library.opcheck(OP, grad_args)


@pytest.mark.parametrize("fmt,group_size", CASES)
def test_grad_input_operator_passes_opcheck(fmt, group_size):
    """The backward's operator (grad @ dequantized W): opcheck, and its value on the CPU."""
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 192
    qw = quantize(torch.randn(n, k, generator=gen), fmt, group_size)
    grad = torch.randn(2, 3, n, generator=gen)
    args = (grad, list(qw.planes), qw.scales, qw.format, n, k, qw.group_size, qw.dtype, qw.tile)
    grad_op = torch.ops.lightspeed.quantized_matmul_grad_input.default
    torch.library.opcheck(grad_op, args)
    torch.testing.assert_close(grad_op(*args), grad @ qw_dequant(qw))


def _grads(fn, x, bias, grad):
    x = x.detach().clone().requires_grad_(True)
    bias.grad = None
    fn(x).backward(grad)
    return x.grad, bias.grad


@pytest.mark.parametrize("fmt,group_size", CASES)
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32)] + ([("cuda", torch.float16),
                                                                       ("cuda", torch.bfloat16)]
                                                                      if torch.cuda.is_available() else []))
def test_gradients_reach_x_and_bias(fmt, group_size, device, dtype):
    """An x that needs a gradient (adapters on a frozen quantized model) gets F.linear's gradient with
    the dequantized weight, and the bias its own, eager and under torch.compile; the packed weight gets
    none. On CUDA the kernel's output has no graph of its own, so this checks the operator's formula."""
    torch.manual_seed(4)
    lin = nn.Linear(192, 72).to(device, dtype)
    q = QuantizedLinear.from_linear(lin, weight=fmt, group_size=group_size)
    q.bias.requires_grad_(True)
    w = q.dequantize_weight().to(dtype)
    ref_bias = q.bias.detach().clone().requires_grad_(True)
    x = torch.randn(2, 9, 192, device=device, dtype=dtype)
    grad = torch.randn(2, 9, 72, device=device, dtype=dtype)
    ref = _grads(lambda t: nn.functional.linear(t, w, ref_bias), x, ref_bias, grad)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch._dynamo.reset()
    for fn in (q, torch.compile(q, backend="aot_eager", fullgraph=True)):
        got = _grads(fn, x, q.bias, grad)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol * r.float().abs().max().item())
    assert not q.qweight.requires_grad and q.qweight.grad is None
    with torch.no_grad():  # inference keeps the direct kernel path
        assert q(x.requires_grad_(True)).grad_fn is None


def qw_dequant(qw):
    from lightspeed.ops.wquant import dequantize

    return dequantize(qw, dtype=torch.float32)


def test_compile_still_validates_inputs():
    model = _MLP("int8", None, torch.float32, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match="expects K=192"):
        compiled(torch.randn(2, 100))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor + Triton kernel on CUDA")
@pytest.mark.parametrize("fmt,group_size,dtype", [("fp6", None, torch.float16), ("int8", None, torch.bfloat16),
                                                  ("int4", 32, torch.float16)])
def test_inductor_and_cuda_graph_on_cuda(fmt, group_size, dtype):
    """Inductor (fullgraph) around the Triton kernel matches the eager model for M = 1, 5, 40, 130; the
    compiled step captured in a CUDA graph and replayed with new inputs matches too."""
    model = _MLP(fmt, group_size, dtype, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    with torch.no_grad():
        for m in (1, 5, 40, 130):
            x = torch.randn(m, 192, generator=gen).to("cuda", dtype)
            ref = model(x).float()
            torch.testing.assert_close(compiled(x).float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        x = torch.randn(4, 192, generator=gen).to("cuda", dtype)
        compiled(x)  # warm: tuned, planned, compiled for this shape
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = compiled(x)
        for _ in range(2):
            x.copy_(torch.randn(4, 192, generator=gen).to("cuda", dtype))
            graph.replay()
            torch.cuda.synchronize()
            ref = model(x).float()
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA graphs (cudagraph trees) on CUDA")
@pytest.mark.parametrize("fmt", ["fp6", "int4"])
def test_reduce_overhead_on_cuda(fmt):
    """mode="reduce-overhead" runs each new shape's first call (where the kernel autotunes) in a warm-up
    whose memory pool must hold nothing afterwards but the outputs: the split-K scratch buffers are sized
    when the layers reach the GPU, and launch plans keep no tensors of the call that made them. Shapes no
    other test uses, so the kernel's first call at them is inside the compiled warm-up."""
    model = _MLP(fmt, None, torch.float16, "cuda", k=200, hidden=176, n=88)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for m in (3, 3, 3, 7, 7, 7):
            x = torch.randn(m, 200, generator=gen).to("cuda", torch.float16)
            ref = model(x).float()
            torch.testing.assert_close(compiled(x).float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers compiles generate's forward on CUDA only")
@pytest.mark.parametrize("fmt", ["fp6", "int8"])
def test_generate_with_a_static_cache_on_cuda(fmt):
    """transformers (>= 4.5x) compiles the forward with mode="reduce-overhead" when generate uses a static
    cache on a GPU: a quantized model takes that path, and its logits follow the eager model's."""
    transformers = pytest.importorskip("transformers")
    from lightspeed.inference import init_inference

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=96, intermediate_size=224, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=120, max_position_embeddings=128)
    model = init_inference(transformers.LlamaForCausalLM(cfg).eval(), dtype=torch.float16, quant={"weight": fmt})
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(5)).cuda()
    torch._dynamo.reset()

    def logits(**kw):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                             cache_implementation="static", **kw)
        return torch.stack(out.logits).float()

    want = logits(disable_compile=True)
    got = logits()
    assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's scratch buffers are CUDA's")
def test_scratch_buffers_do_not_grow_after_a_layer_is_placed():
    from lightspeed.ops.wquant import launch

    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(256, 20000).to("cuda", torch.float16), weight="int4")
    device = layer.qweight.device
    ws, cnt = launch.workspaces[device], launch.counters[device]
    with torch.no_grad():
        for m in (1, 5, 16, 40, 64, 200, 1000):
            layer(torch.randn(m, 256, device="cuda", dtype=torch.float16))
    assert launch.workspaces[device] is ws and launch.counters[device] is cnt
