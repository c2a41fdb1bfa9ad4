"""modeling_boost.py: BOOST's low-rank Llama (CoLA, svd, LaX) in transformers' terms.

BOOST (arXiv 2512.12131) section 2, CoLA (arXiv 2502.10940), LaX (arXiv 2505.21732): the forward
pass of this project's model.py, written for transformers (PreTrainedModel, GenerationMixin) and
copied into an exported folder by interchange.py, so that the folder needs nothing of the project.
Every projection of a layer (q, k, v, o, gate, up, down) is a bottleneck y = B·σ(A·x), σ = SiLU
(cola) or the identity (svd); under LaX a latent also reads the same projection's latent of the
layer before through a gate G and a LayerNorm over r: h = σ(LayerNorm(A·x + G(h_prev))).
The tests check its logits against model.py's (fp32, 1e-5). No KV cache: generate() runs the
whole sequence at each step. Shapes: b batch, s sequence, d hidden, r rank, h heads, hd head dim.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_boost import BoostConfig


class Crossing(nn.Module):
    """LaX's gate G on the previous layer's latent and the LayerNorm over r (eps 1e-6)."""

    def __init__(self, r, gate):
        super().__init__()
        self.gate, self.norm = gate, nn.LayerNorm(r, eps=1e-6)
        if gate == "kron":   # r = r1·r2, the most balanced pair; G(h) = vec(Dᵀ·mat(h)·E)
            r1 = max(a for a in range(1, math.isqrt(r) + 1) if r % a == 0)
            self.D = nn.Parameter(torch.empty(r1, r1))
            self.E = nn.Parameter(torch.empty(r // r1, r // r1))
        elif gate == "linear":
            self.W = nn.Linear(r, r)

    def forward(self, z, h_prev):
        if self.gate == "kron":
            m = h_prev.unflatten(-1, (self.D.shape[0], self.E.shape[0]))       # (b, s, r1, r2)
            g = torch.einsum("...ij,ik,jl->...kl", m, self.D, self.E).flatten(-2)  # (b, s, r)
        else:
            g = self.W(h_prev) if self.gate == "linear" else h_prev
        return self.norm(z + g)                                                # (b, s, r)


class Bottleneck(nn.Module):
    """y = B·σ(A·x): A (r, d_in), B (d_out, r); `cross`: LaX's crossing (layers after the first)."""

    def __init__(self, d_in, d_out, r, config, crosses):
        super().__init__()
        self.A = nn.Linear(d_in, r, bias=False)
        self.B = nn.Linear(r, d_out, bias=False)
        self.silu = config.boost_arch == "cola"
        self.cross = Crossing(r, config.lax_gate) if crosses else None

    def forward(self, x, h_prev=None):
        z = self.A(x)                                   # (b, s, r)
        if self.cross is not None:
            z = self.cross(z, h_prev)
        h = F.silu(z) if self.silu else z
        return self.B(h), h                             # (b, s, d_out), the latent for the next


def rotate(x, cos, sin):
    """RoPE in the rotate-half form on x (b, h, s, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class BoostAttention(nn.Module):
    def __init__(self, config, crosses):
        super().__init__()
        d, r = config.hidden_size, config.attn_rank
        self.h, self.kvh = config.num_attention_heads, config.num_key_value_heads
        self.hd, kv = d // self.h, config.num_key_value_heads * (d // self.h)
        self.q_proj, self.k_proj = Bottleneck(d, d, r, config, crosses), \
            Bottleneck(d, kv, r, config, crosses)
        self.v_proj, self.o_proj = Bottleneck(d, kv, r, config, crosses), \
            Bottleneck(d, d, r, config, crosses)

    def forward(self, x, cos, sin, mask, prev):
        b, s, _ = x.shape
        (q, hq), (k, hk), (v, hv) = (p(x, h) for p, h in
                                     zip((self.q_proj, self.k_proj, self.v_proj), prev))
        q = rotate(q.view(b, s, self.h, self.hd).transpose(1, 2), cos, sin)     # (b, h, s, hd)
        k = rotate(k.view(b, s, self.kvh, self.hd).transpose(1, 2), cos, sin)   # (b, kvh, s, hd)
        v = v.view(b, s, self.kvh, self.hd).transpose(1, 2)
        if self.kvh != self.h:   # grouped-query attention: each k, v head serves h/kvh q heads
            k, v = (t.repeat_interleave(self.h // self.kvh, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out, ho = self.o_proj(y.transpose(1, 2).reshape(b, s, -1), prev[3])     # (b, s, d)
        return out, (hq, hk, hv, ho)


class BoostMLP(nn.Module):
    def __init__(self, config, crosses):
        super().__init__()
        d, f, r = config.hidden_size, config.intermediate_size, config.mlp_rank
        self.silu = config.mlp_gate == "silu"
        self.gate_proj = Bottleneck(d, f, r, config, crosses)
        self.up_proj = Bottleneck(d, f, r, config, crosses)
        self.down_proj = Bottleneck(f, d, r, config, crosses)

    def forward(self, x, prev):
        (g, hg), (u, hu) = self.gate_proj(x, prev[0]), self.up_proj(x, prev[1])
        out, hd = self.down_proj((F.silu(g) if self.silu else g) * u, prev[2])   # (b, s, d)
        return out, (hg, hu, hd)


class BoostDecoderLayer(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        crosses = config.lax and index > 0   # (layer 0 only emits its latents)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = BoostAttention(config, crosses)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = BoostMLP(config, crosses)

    def forward(self, x, cos, sin, mask, prev):
        a, lat_attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, prev[:4])
        x = x + a
        m, lat_mlp = self.mlp(self.post_attention_layernorm(x), prev[4:])
        return x + m, lat_attn + lat_mlp   # the seven latents: q, k, v, o, gate, up, down


class BoostPreTrainedModel(PreTrainedModel):
    config_class = BoostConfig
    base_model_prefix = "model"
    _no_split_modules = ["BoostDecoderLayer"]

    def _init_weights(self, module):
        """What a missing weight starts from (a folder from export has them all)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, Crossing) and module.gate == "kron":
            nn.init.kaiming_uniform_(module.D)
            nn.init.kaiming_uniform_(module.E)


class BoostModel(BoostPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BoostDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        """(b, s) ids -> (b, s, d). attention_mask (b, s), 1 for tokens and 0 for padding (left or
        right): padding is never attended to, and positions count the tokens only."""
        b, s = input_ids.shape
        if s == 0:   # (else a reshape error deep inside)
            raise ValueError("input_ids holds no tokens: a forward needs at least one")
        hd = self.config.hidden_size // self.config.num_attention_heads
        if attention_mask is None:
            pos, mask = torch.arange(s, device=input_ids.device).expand(b, s), None
        else:
            keep = attention_mask.bool()
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)                  # (b, s)
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            mask = (causal & keep[:, None, :])[:, None] | torch.eye(s, dtype=torch.bool,
                                                                   device=input_ids.device)
        inv = self.config.rope_theta ** (-torch.arange(0, hd, 2, device=input_ids.device).float()
                                         / hd)
        angles = pos[:, None, :, None].float() * inv                           # (b, 1, s, hd/2)
        x = self.embed_tokens(input_ids)                                                # (b, s, d)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        lat = (None,) * 7
        for layer in self.layers:
            x, lat = layer(x, cos, sin, mask, lat)
        return self.norm(x)


class BoostForCausalLM(BoostPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = BoostModel(config)
        # tied: the head is the embedding itself (no second parameter to tie)
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        x = self.model(input_ids, attention_mask)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)                                                      # (b, s, V)
        loss = None
        if labels is not None:   # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: the whole sequence each step."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
