"""A small GPT: the model of the lightspeed demo and of the GPU benchmarks.

Decoder-only transformer in the GPT-2 shape: token + learned position embeddings, pre-LayerNorm blocks
(causal self-attention through ``F.scaled_dot_product_attention``, GELU MLP), a final LayerNorm and an
LM head tied to the token embedding. Plain PyTorch, no lightspeed imports: the engine must work on an
unchanged model. Import it as ``examples.gpt`` from the repository root or load it by path.
"""

import math
import re
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size from ``PRESETS``, or ``WIDTHxLAYERS`` (GPT-2's padded vocabulary, 128-wide heads:
        ``4096x8`` is a 7B-shaped model of 8 layers), with any field overridden (e.g. ``block_size=512``)."""
        shape = re.fullmatch(r"(\d+)x(\d+)", name)
        if shape is not None:
            width, layers = map(int, shape.groups())
            return replace(PRESETS["gpt2"], n_layer=layers, n_head=max(1, width // 128), n_embd=width, **overrides)
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {', '.join(PRESETS)} or WIDTHxLAYERS")
        return replace(PRESETS[name], **overrides)


# "demo" is byte-level and sized to learn visibly in about a minute on two CPU cores. The others use
# GPT-2's vocabulary padded to a multiple of 64 (50304) and are there for the GPU benchmarks.
PRESETS: dict[str, GPTConfig] = {
    "demo": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "1.3b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
    # GPT-3's 2.7B and 6.7B shapes, for the offload size sweep (benchmarks/offload.py)
    "2.7b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=2560),
    "6.7b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # the head count comes from the tensors (-1), so a tensor-parallel rank holding a slice of the
        # heads (c_attn split by rows within each of q, k, v) runs the same code
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # lightspeed's `kernels.fused_linear_cross_entropy` sets this to its fused (hidden, weight, targets) -> loss:
    # the loss from the final hidden states in chunks, the logits never materialised whole
    lightspeed_fused_lm_loss = None

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, registered under both names
        for name, module in self.named_modules():
            if name.endswith("c_proj"):
                module.residual_proj = True  # writes into the residual stream (_init_weights scales it)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, and the projections that write into the
        residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow with depth."""
        for module in self.modules():
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """`init_weights`' rule for one module (the per-module hook that ZeRO-3's materialization of a
        meta-built model, and `zero.Init`, apply as Hugging Face models' is)."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(module, "residual_proj", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) int64 token ids with T <= block_size; targets: (B, T) int64 or None.

        Returns the mean cross-entropy loss (a scalar) when targets is given, else the logits
        (B, T, vocab_size) in the compute dtype.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None and self.lightspeed_fused_lm_loss is not None:
            return self.lightspeed_fused_lm_loss(x, self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters (the tied head counts once); ``non_embedding`` drops both embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), the PaLM appendix B / nanoGPT MFU estimate:
        6 * N for the weight matmuls plus 12 * n_layer * n_embd * seq_len for attention scores and
        values. N excludes the position embedding (a lookup, no matmul) but keeps the tied token
        embedding, which is the LM head's matmul. The attention term ignores causal masking, as PaLM's does.
        """
        T = seq_len or self.config.block_size
        N = self.num_params() - self.wpe.weight.numel()
        return 6 * N + 12 * self.config.n_layer * self.config.n_embd * T

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens tokens; temperature 0 is greedy. Returns (B, T + new)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
