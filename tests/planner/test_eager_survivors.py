"""planner/eager.py, what its other tests left open (mutation testing, tests/mutate.py --module
planner/eager.py: 3 of 84 mutants survived tests/planner, 2 of them equivalent): a one-layer model's
parameter tensors."""

from __future__ import annotations

from planner.eager import param_tensors
from planner.models import ModelSpec
from planner.plan import Layout


def test_a_one_layer_models_parameter_tensors() -> None:
    # a Llama layer: 2 norms, q/k/v/o and gate/up/down = 9 tensors; plus embedding, final norm and head
    model = ModelSpec(name="one", num_layers=1, hidden_size=64, num_attention_heads=4, num_kv_heads=4, head_dim=16,
                      ffn_hidden_size=128, vocab_size=100)
    assert param_tensors(model, Layout(1, 1)) == 9 + 3
    two = ModelSpec(name="two", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4, head_dim=16,
                    ffn_hidden_size=128, vocab_size=100, qk_norm=True)
    assert param_tensors(two, Layout(1, 1)) == 2 * 11 + 3 and param_tensors(two, Layout(1, 2)) == 11 + 3
