"""configuration_boost.py: the configuration of BOOST's low-rank Llama in transformers' terms.

BOOST (arXiv 2512.12131) section 2, CoLA (arXiv 2502.10940), LaX (arXiv 2505.21732). Written by
`python interchange.py export CHECKPOINT FOLDER --format=hf` into the folder, beside
modeling_boost.py, and named by config.json's `auto_map`, so that
`AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)` and lm-evaluation-harness
(`lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True`) read the model with no
package of this project installed. The Llama fields keep their transformers names; the bottleneck
ones are this project's (model.Config):

    boost_arch   cola: y = B·SiLU(A·x) in every projection; svd: y = B·A·x
    attn_rank    r of q, k, v, o;  mlp_rank: r of gate, up, down
    mlp_gate     silu: down(silu(gate)·up);  none: down(gate·up)
    lax          LaX's latent crossing between consecutive layers
    lax_gate     kron | linear | identity: its gate on the previous layer's latent
"""
from transformers import PretrainedConfig


class BoostConfig(PretrainedConfig):
    model_type = "boost"

    def __init__(self, vocab_size=320, hidden_size=128, intermediate_size=352,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=None,
                 max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False, boost_arch="cola", attn_rank=32, mlp_rank=32,
                 mlp_gate="none", lax=False, lax_gate="kron", **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.max_position_embeddings, self.rms_norm_eps = max_position_embeddings, rms_norm_eps
        self.rope_theta = rope_theta
        self.boost_arch, self.attn_rank, self.mlp_rank = boost_arch, attn_rank, mlp_rank
        self.mlp_gate, self.lax, self.lax_gate = mlp_gate, lax, lax_gate
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
