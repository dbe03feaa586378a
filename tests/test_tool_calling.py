"""Tool-calling rollouts (docs/training.md, "Tool-calling rollouts"): the trust-region losses on batches that went
through TRL's own tool loop (`tools=` and `environment_factory=`). The tokens TRL appends for a tool's result carry
`tool_mask == 0`: they must take no part in the loss, its gradient, the bounds' statistics or the count metrics.

The tiny model is built here: a byte-level tokenizer as `trl_bandpo.demo.tiny_model`'s, with `<tool_call>` and
`</tool_call>` as added tokens, a ChatML template that renders tool calls and tool messages, a `response_template`
that parses them, and the tiny Qwen2 model given a brief supervised warm start on a tool-calling conversation (and a
plain chat), so that it calls the tool when sampled. TRL parses the call, runs the tool, appends the result and
generates again: the `tool_mask` zeros below are TRL's own. The expected loss, gradients, bounds and counts are
computed here from the per-token formulas of docs/band-operator.md, docs/band-and-dppo.md and docs/metrics.md on the
tokens with `completion_mask * tool_mask == 1` only, with a float64 bisection for the Band KL bounds."""

import math

import pytest
import torch
from datasets import Dataset

from trl_bandpo import BandPOConfig, BandPOTrainer
from trl_bandpo.demo.tiny_model import build_tiny_model, build_tiny_tokenizer

# ChatML; the tools' names in a system turn; an assistant turn's tool calls as JSON between <tool_call> tags.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# How transformers' `parse_response` reads a generated assistant turn of CHAT_TEMPLATE back into a message.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>", "close_pattern": "</tool_call>", "repeats": True, "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}  # fmt: skip
TOOL_PROMPT = [{"role": "user", "content": "add 2 and 3"}]
CHAT_PROMPT = [{"role": "user", "content": "say hi"}]
TOOL_RESULT = "the sum is 5"
#: What TRL appends after the tool call's end of turn, all of it with `tool_mask == 0`.
TOOL_SUFFIX = f"\n<|im_start|>tool\n{TOOL_RESULT}<|im_end|>\n<|im_start|>assistant\n"
NUM_GENERATIONS = 2
MAX_COMPLETION_LENGTH = 96
ADVANTAGES = torch.tensor([1.3, -0.7, 0.9, -1.1])  # rows: tool, tool, chat, chat
BAND_RADIUS, BAND_UPPER_MAX, TV_RADIUS, RATIO_CAP = 0.05, 10.0, 0.15, 20.0
BUCKETS = ("p0.0-0.2", "p0.2-0.4", "p0.4-0.6", "p0.6-0.8", "p0.8-1.0")


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return f"the sum is {a + b}"


class Calculator:
    """An `environment_factory` environment: its public method is the tool."""

    def reset(self, **kwargs):
        return None

    def add(self, a: int, b: int) -> str:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return add(a, b)


def build_tool_tokenizer():
    tool_tokens = ("<tool_call>", "</tool_call>")
    specials = ["<|im_start|>", *tool_tokens]
    tokenizer = build_tiny_tokenizer(tool_tokens, CHAT_TEMPLATE, additional_special_tokens=specials)
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def _warm_start_conversations(tokenizer):
    """Token ids and labels (-100 outside the assistant's turns) of two tool-calling conversations and two plain
    ones, right-padded, with their attention mask."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    calls = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    conversations = [  # two answers each: the first token of the answer has a probability near 1/2
        (TOOL_PROMPT, calls, [TOOL_SUFFIX, "5<|im_end|>"]),
        (TOOL_PROMPT, calls, [TOOL_SUFFIX, "five<|im_end|>"]),
        (CHAT_PROMPT, [{"role": "assistant", "content": "hi"}], []),
        (CHAT_PROMPT, [{"role": "assistant", "content": "hello"}], []),
    ]
    rows = []
    for prompt, reply, rest in conversations:
        prompt_text = tokenizer.apply_chat_template(prompt, tools=[add], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(prompt + reply, tools=[add], tokenize=False)
        reply_text = full[len(prompt_text) :].removesuffix("\n")  # TRL's turn ends at the end-of-turn token
        ids, labels = [], []
        for k, text in enumerate([prompt_text, reply_text, *rest]):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if k % 2 else [-100] * len(piece)
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows])
    return ids, labels, (ids != tokenizer.pad_token_id).long()


@pytest.fixture(scope="module")
def warm_state():
    """The weights of the tiny model after a supervised warm start (seconds on CPU): it answers TOOL_PROMPT with a
    call of `add`, the tool's result with "5" or "five", and CHAT_PROMPT with "hi" or "hello"."""
    tokenizer = build_tool_tokenizer()
    model = build_tiny_model(tokenizer)
    ids, labels, attention = _warm_start_conversations(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05  # near its floor: the two answers of each prompt share their probability
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _model(warm_state):
    model = build_tiny_model(build_tool_tokenizer())
    model.load_state_dict(warm_state)
    return model


def alternating_reward(completions, **kwargs):
    """0, 1, 0, 1, ...: every group of two has a signal."""
    return [float(k % 2) for k in range(len(completions))]


def _dataset():
    return Dataset.from_list([{"prompt": TOOL_PROMPT}, {"prompt": CHAT_PROMPT}] * 2)


def _trainer(warm_state, output_dir, policy_loss, environment=False, trainer_class=BandPOTrainer, **overrides):
    args = BandPOConfig(
        output_dir=str(output_dir), policy_loss=policy_loss, per_device_train_batch_size=4,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION_LENGTH,
        num_iterations=2,  # TRL's old-policy pass runs at generation: the stored old log-probs and bounds
        gradient_accumulation_steps=1, max_steps=2, learning_rate=0.02, logging_steps=1, report_to="none",
        use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, max_tool_calling_iterations=1,
        band_radius=BAND_RADIUS, band_upper_max=BAND_UPPER_MAX, dppo_tv_radius=TV_RADIUS, dppo_ratio_cap=RATIO_CAP,
        **overrides,
    )  # fmt: skip
    tools = {"environment_factory": Calculator} if environment else {"tools": [add]}
    return trainer_class(model=_model(warm_state), reward_funcs=alternating_reward, args=args,
                         train_dataset=_dataset(), processing_class=build_tool_tokenizer(), **tools)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# The expectation, by hand
# ------------------------------------------------------------------------------------------------------------------


def _binary_kl(p, r):
    """KL(Bern(p) || Bern(r p)) in float64, as `p f(r) + (1 - p) f(c)`, `f(u) = u - 1 - log u`, `c` the rescaled
    rest (docs/band-operator.md); 0 for the rest's term at p = 1."""
    rest = 1 - p
    x = r - 1
    y = -x * p / torch.where(rest > 0, rest, torch.ones_like(rest))
    term = torch.where(rest > 0, rest * (y - torch.log1p(y)), torch.zeros_like(p))
    return p * (x - torch.log1p(x)) + term


def band_kl_by_bisection(old_logps, radius, upper_max, steps=200):
    """The Band KL bounds by 200 halvings of `[0, 1]` (lower) and `[1, 1/p]` (upper), in float64, capped."""
    p = old_logps.double().exp()
    lo, hi = torch.zeros_like(p), torch.ones_like(p)
    for _ in range(steps):  # the KL decreases on [0, 1]: above the radius, the root is to the right
        mid = (lo + hi) / 2
        above = _binary_kl(p, mid) > radius
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    lower = hi
    lo, hi = torch.ones_like(p), 1 / p
    for _ in range(steps):  # it increases on [1, 1/p]
        mid = (lo + hi) / 2
        above = _binary_kl(p, mid) > radius
        lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
    return lower, lo.clamp(max=upper_max)


def tv_bounds(old_logps, radius):
    """DPPO-TV: `|q - p| <= radius` as ratios, `[max(0, 1 - radius/p), min(1 + radius/p, 1/p)]`."""
    p = old_logps.double().exp()
    return (1 - radius / p).clamp(min=0), torch.minimum(1 + radius / p, 1 / p)


def _forward(model, inputs):
    """The model's log-probs of the completion tokens and its entropies there, by a plain forward pass."""
    prompt_length = inputs["prompt_ids"].shape[1]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, prompt_length - 1 : -1].double()
    log_probs = torch.log_softmax(logits, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1), entropy.detach()


def expected(policy_loss, model, inputs):
    """Loss (with its graph), the count metrics `{name: (numerator, denominator)}` and TRL's metrics, by hand, on
    the tokens with `completion_mask * tool_mask == 1` only."""
    keep = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    logps, entropy = _forward(model, inputs)
    old = inputs["old_per_token_logps"].double()
    if policy_loss == "band":
        lower, upper = band_kl_by_bisection(old, BAND_RADIUS, BAND_UPPER_MAX)
    else:
        lower, upper = tv_bounds(old, TV_RADIUS)
    A = inputs["advantages"].double()[:, None].expand_as(old)
    log_ratio = logps - old
    r = log_ratio.exp()
    # only the kept tokens from here on: flat vectors
    log_ratio, r, A, lower, upper, p = log_ratio[keep], r[keep], A[keep], lower[keep], upper[keep], old[keep].exp()
    below, above = r.detach() < lower, r.detach() > upper
    low, high = below & (A < 0), above & (A > 0)
    if policy_loss == "band":  # PPO's clipped surrogate with the Band bounds
        per_token = -torch.minimum(r * A, torch.clamp(r, lower, upper) * A)
    else:  # DPPO: forward -A min(r, C); weight min(r, C) on grad log pi, 0 where the region is left along A
        weight = torch.where(low | high, 0.0, r.detach().clamp(max=RATIO_CAP))
        per_token = -A * (r.detach().clamp(max=RATIO_CAP) + weight * (log_ratio - log_ratio.detach()))
    loss = per_token.sum() / keep.sum()  # loss_type "dapo", one process, one step per generation

    def count(x):
        return float(x.sum())

    tokens, tail = float(keep.sum()), p < 0.2
    counts = {
        "bounds/lower_mean": (float(lower.sum()), tokens),
        "bounds/upper_mean": (float(upper.sum()), tokens),
        "clip_ratio/high_tail_share": (count(high & tail), count(high)),
        "clip_ratio/any_sign_mean": (count(below | above), tokens),
        "clip_ratio/any_sign_tail_high_share": (count(above & tail), count(below | above)),
    }
    edges = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    for name, left, right in zip(BUCKETS, edges[:-1], edges[1:]):
        bucket = (p >= left) & ((p < right) if right < 1 else (p <= right))  # the last bucket holds p = 1
        counts[f"clip_ratio_by_prob/low/{name}"] = (count(low & bucket), count(bucket))
        counts[f"clip_ratio_by_prob/high/{name}"] = (count(high & bucket), count(bucket))
    if policy_loss == "dppo_tv":
        counts["dppo/masked_pos_share"] = (count(high), count(A > 0))
        counts["dppo/masked_neg_share"] = (count(low), count(A < 0))
        counts["dppo/truncated_share"] = (count(~(low | high) & (r.detach() > RATIO_CAP)), tokens)
    rows = keep.nonzero()[:, 0]

    def row_shares(flags):
        per_row = [flags[rows == row].double().mean() for row in rows.unique()]
        return torch.stack(per_row)

    trl_metrics = {
        "entropy": float(entropy[keep].mean()),
        "clip_ratio/low_mean": count(low) / tokens,
        "clip_ratio/high_mean": count(high) / tokens,
        "clip_ratio/region_mean": count(low | high) / tokens,
        "clip_ratio/low_min": float(row_shares(low).min()),
        "clip_ratio/high_max": float(row_shares(high).max()),
    }
    return loss, counts, trl_metrics, (lower, upper)


# ------------------------------------------------------------------------------------------------------------------
# A tool-calling rollout through TRL's tool loop
# ------------------------------------------------------------------------------------------------------------------


def _perturb(model, seed, scale=0.2):
    """Moves every weight by noise of `scale` times its tensor's spread."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))


class MovedOldPolicyTrainer(BandPOTrainer):
    """The weights move by noise after generation, before TRL's old-policy pass: with other noise before the loss,
    the ratios spread to both sides of 1 (the warm-started model gives most sampled tokens a probability near 1, so
    noise on the current policy alone would only lower them)."""

    def _generate(self, prompts):
        result = super()._generate(prompts)
        _perturb(self.model, seed=1, scale=0.5)  # strong enough to put some sampled tokens in the tail
        return result


@pytest.fixture(scope="module", params=["band", "dppo_tv"])
def rollout(request, warm_state, tmp_path_factory):
    """A generation batch of TRL's, two rows calling the tool and two plain chats, with fixed advantages of both
    signs; the old policy and the current one are the generating weights moved by two independent noises."""
    # in float32 (on CPU the config's default is bf16 autocast): the hand-built forward below is float32 too
    trainer = _trainer(warm_state, tmp_path_factory.mktemp(request.param), request.param, bf16=False,
                       trainer_class=MovedOldPolicyTrainer)  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what TRL's training loop sets
    torch.manual_seed(0)
    dataset = trainer.train_dataset
    inputs = trainer._generate_and_score_completions([dataset[0], dataset[0], dataset[1], dataset[1]])
    generation_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    inputs["advantages"] = ADVANTAGES.clone()
    # the current policy: the first noise (from seed 2 on) under which the batch reaches every region the counts
    # tell apart (which one does depends on the libraries' sampling; the tests below assert that it is reached)
    generating = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    for seed in range(2, 42):
        trainer.model.load_state_dict(generating)
        _perturb(trainer.model, seed=seed)
        with torch.no_grad():
            _, counts, metrics, _ = expected(request.param, trainer.model, inputs)
        if metrics["clip_ratio/low_mean"] > 0 and counts["clip_ratio/high_tail_share"][0] > 0:
            break
    return trainer, inputs, generation_metrics


def _tool_positions(inputs):
    return (inputs["completion_mask"] == 1) & (inputs["tool_mask"] == 0)


def _run(trainer, inputs):
    """Loss, gradients, count metrics and TRL's loss metrics of one `_compute_loss` on `inputs`."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._count_window("train").clear()
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    counts = {name: tuple(pair) for name, pair in trainer._count_window("train").items()}
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), grads, counts, metrics


def test_the_rollout_went_through_trls_tool_loop(rollout):
    """The tool rows hold the model's call of `add`, then TRL's tool turn with the result, all of it and nothing else
    with tool_mask 0, then the model's answer; the chat rows have no tool tokens. TRL counted the call."""
    trainer, inputs, generation_metrics = rollout
    tokenizer = trainer.processing_class
    tool = _tool_positions(inputs)
    for row in range(4):
        ids = inputs["completion_ids"][row]
        if row < 2:
            assert tokenizer.decode(ids[tool[row]]) == TOOL_SUFFIX
            text = tokenizer.decode(ids[inputs["completion_mask"][row].bool()])
            assert text.startswith('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>')
            assert TOOL_SUFFIX in text
        else:
            assert not tool[row].any()
    assert generation_metrics["tools/call_frequency"] == 0.5 and generation_metrics["tools/failure_frequency"] == 0
    # TRL's token counts leave the tool's tokens out
    keep = inputs["completion_mask"] * inputs["tool_mask"]
    assert int(inputs["num_items_in_batch"]) == int(keep.sum())
    assert generation_metrics["completions/mean_length"] == pytest.approx(float(keep.sum(1).double().mean()))


def test_loss_gradients_bounds_and_counts_match_a_hand_count_without_tool_tokens(rollout):
    """The loss, every gradient, the per-token bounds and every count metric (and TRL's clip ratios and entropy)
    equal the hand-built expectation over the model's own tokens; the same expectation with the tool's tokens
    counted differs, so the comparison can fail."""
    trainer, inputs, _ = rollout
    policy_loss = trainer.policy_loss
    loss, grads, counts, metrics = _run(trainer, inputs)
    want_loss, want_counts, want_metrics, (lower, upper) = expected(policy_loss, trainer.model, inputs)
    want_loss.backward()
    want_grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss.double(), want_loss.detach(), rtol=1e-5, atol=1e-7)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        want = want_grads[name].float()  # float32 forwards, a fused head against log_softmax: rounding of ~1e-4
        torch.testing.assert_close(grad, want, rtol=1e-3, atol=1e-5 * float(want.abs().max()), msg=name)
    keep = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
    got_lower, got_upper = inputs["policy_lower_bound"][keep].double(), inputs["policy_upper_bound"][keep].double()
    torch.testing.assert_close(got_lower, lower, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_upper, upper, rtol=1e-5, atol=1e-7)
    assert counts.keys() == want_counts.keys()
    for name, (numerator, denominator) in want_counts.items():
        assert counts[name][1] == denominator, name
        assert counts[name][0] == pytest.approx(numerator, rel=1e-5, abs=1e-6), name
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    # the inputs reach the regions the counts distinguish: clipped low and high, high in the tail, below the bounds
    # with A > 0 (counted by any_sign_mean only)
    assert want_metrics["clip_ratio/low_mean"] > 0 and want_counts["clip_ratio/high_tail_share"][0] > 0
    assert want_counts["clip_ratio/any_sign_mean"][0] > want_counts["clip_ratio/high_tail_share"][1] + sum(
        want_counts[f"clip_ratio_by_prob/low/{bucket}"][0] for bucket in BUCKETS
    )
    # counting the tool's tokens too would give other numbers
    with_tool = dict(inputs, tool_mask=torch.ones_like(inputs["tool_mask"]))
    other_loss, other_counts, _, _ = expected(policy_loss, trainer.model, with_tool)
    assert not torch.isclose(other_loss.detach(), want_loss.detach())
    assert other_counts["bounds/lower_mean"][1] > want_counts["bounds/lower_mean"][1]


def test_log_probs_at_tool_positions_change_nothing(rollout, monkeypatch):
    """Other old and current log-probs (so other bounds and ratios, many out of the bounds) and entropies at the
    tool-result positions leave the loss, every gradient and every metric bit for bit as they were; the same change
    on one token of the model's changes them."""
    trainer, inputs, _ = rollout
    before = _run(trainer, inputs)
    tool = _tool_positions(inputs)
    control = torch.zeros_like(tool)
    control[0, 0] = True  # the first token of the tool call, positive advantage
    generator = torch.Generator().manual_seed(2)
    # down to log-ratios above float32's largest exponent (a tool's text can be that unlikely): no inf * 0 either
    fake_old = torch.empty(tool.shape).uniform_(-120.0, -0.05, generator=generator)
    fake_new = torch.empty(tool.shape).uniform_(-6.0, -0.05, generator=generator)
    fake_entropy = torch.empty(tool.shape).uniform_(0.0, 5.0, generator=generator)
    original = trainer._get_per_token_logps_and_entropies

    def runs_with_changes_at(where):
        def changed_forward(*args, **kwargs):
            logps, entropies, aux = original(*args, **kwargs)
            return torch.where(where, fake_new, logps), torch.where(where, fake_entropy, entropies), aux

        old = torch.where(where, fake_old, inputs["old_per_token_logps"])
        lower, upper = trainer._policy_bounds(old)  # as generation would have stored them
        changed = dict(inputs, old_per_token_logps=old, policy_lower_bound=lower, policy_upper_bound=upper)
        assert not torch.equal(lower[where], inputs["policy_lower_bound"][where])
        ratio = (fake_new - fake_old)[where].exp()
        assert ((ratio < lower[where]) | (ratio > upper[where])).any(), "no changed token leaves the bounds"
        monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", changed_forward)
        try:
            return _run(trainer, changed)
        finally:
            monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", original)

    after = runs_with_changes_at(tool)
    loss, grads, counts, metrics = before
    assert torch.equal(after[0], loss)
    assert after[1].keys() == grads.keys() and all(torch.equal(after[1][name], grads[name]) for name in grads)
    assert after[2] == counts
    assert after[3] == metrics
    control_run = runs_with_changes_at(control)
    assert not torch.equal(control_run[0], loss)
    assert control_run[2] != counts and control_run[3] != metrics


class OldEntropiesChangedTrainer(BandPOTrainer):
    """Sets the old policy's entropies to 7 nats at `changed_at`, in TRL's old-policy pass (where the adaptive radius
    reads them)."""

    changed_at = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if entropies is not None and self.changed_at is not None:
            entropies[self.changed_at] = 7.0  # in place: the old-policy pass keeps this very tensor
        return logps, entropies, aux


def test_adaptive_radius_ignores_the_entropies_at_tool_positions(warm_state, tmp_path):
    """With the entropy-adaptive Band radius (`band_radius_by="entropy"`), each token's radius depends on the mean
    old-policy entropy of the batch: other entropies at the tool-result positions leave the bounds of the model's
    tokens and the radius metrics bit for bit as they were; the same change at one model token changes them."""
    trainer = _trainer(warm_state, tmp_path, "band", trainer_class=OldEntropiesChangedTrainer,
                       band_radius_by="entropy")  # fmt: skip
    trainer.model.train()
    dataset = trainer.train_dataset

    def generation(changed_at=None):
        trainer.changed_at = changed_at
        trainer._metrics["train"].clear()
        torch.manual_seed(0)
        output = trainer._generate_and_score_completions([dataset[0], dataset[0], dataset[1], dataset[1]])
        radius = {name: values[-1] for name, values in trainer._metrics["train"].items() if "radius" in name}
        return output, radius

    output, radius = generation()
    assert radius.keys() == {f"bounds/radius_{name}" for name in ("mean", "min", "max", "entropy_corr")}
    keep = (output["completion_mask"] * output["tool_mask"]).bool()
    tool = _tool_positions(output)
    assert tool.any()
    changed_output, changed_radius = generation(tool)
    assert torch.equal(changed_output["completion_ids"], output["completion_ids"])  # the same rollout
    for key in ("policy_lower_bound", "policy_upper_bound"):
        assert torch.equal(changed_output[key][keep], output[key][keep])
    assert changed_radius == radius
    control = torch.zeros_like(keep)
    control[0, 0] = True
    control_output, control_radius = generation(control)
    assert not torch.equal(control_output["policy_upper_bound"][keep], output["policy_upper_bound"][keep])
    assert control_radius != radius


# ------------------------------------------------------------------------------------------------------------------
# Training through TRL's tool loop
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_loss,environment", [("band", False), ("dppo_tv", True)])
def test_training_through_the_tool_loop(warm_state, tmp_path, monkeypatch, policy_loss, environment):
    """Two steps with `tools=[add]` (band) and with `environment_factory=Calculator` (dppo_tv): TRL runs the tool
    for half the prompts, every logged metric is finite (or None: an empty count) and the weights move."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16
    trainer = _trainer(warm_state, tmp_path, policy_loss, environment=environment)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 2
    for entry in steps:
        for name, value in entry.items():
            assert value is None or math.isfinite(value), name
        assert entry["bounds/lower_mean"] < 1 < entry["bounds/upper_mean"]
    assert steps[0]["tools/call_frequency"] > 0
    assert any(not torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters())
