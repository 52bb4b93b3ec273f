"""The grammar mask (engine/grammar_mask.py): applied to logits it equals a token-by-token reference
(disallowed tokens -inf, allowed ones unchanged); a sequence's matcher follows its tokens (through
preemption, tokens taken back, and finishing); constrained generation gives the same tokens with
async scheduling (masks filled after the launch) as without; multi-step rounds fall back to one step."""
import re

import pytest
import torch

from engine.grammar import GrammarTokenizer, choice_grammar, regex_grammar
from engine.grammar_mask import (GrammarMasks, apply_token_bitmask, apply_token_bitmask_reference, unpack_bitmask,
                                 unpack_bitmask_torch)
from scheduler.request import SamplingParams, ScheduledSeq, Sequence, SequenceStatus, next_seq_id
from tests.models import VOCAB, build_tokenizer


@pytest.mark.parametrize("vocab,words", [(64, 2), (100, 4), (384, 12), (100, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_equals_reference(vocab, words, dtype):
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    rows = [4, 0, 2]
    ref = apply_token_bitmask_reference(logits, bitmask, rows)
    out = logits.clone()
    apply_token_bitmask(out, bitmask, torch.tensor(rows))
    assert torch.equal(out, ref)
    assert torch.equal(unpack_bitmask_torch(bitmask, vocab), unpack_bitmask(bitmask, vocab))  # the device's path
    every = logits[rows].clone()
    apply_token_bitmask(every, bitmask, torch.arange(3))  # every row: in place
    assert torch.equal(every, ref[rows])
    allowed = out[rows] != float("-inf")
    assert torch.equal(out[rows][allowed], logits[rows][allowed])  # allowed: unchanged
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a mask: untouched
    if words * 32 < vocab:
        assert torch.isinf(out[rows, words * 32:]).all()  # past the mask: disallowed


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("grammar-tok")
    build_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    return hf, GrammarTokenizer(hf, VOCAB, [hf.eos_token_id])


def constrained_seq(grammar: str | None) -> Sequence:
    return Sequence(next_seq_id(), [5, 6, 7], SamplingParams(max_tokens=64, grammar=grammar), frozenset({2}))


def decode_item(seq: Sequence) -> ScheduledSeq:
    return ScheduledSeq(seq, seq.num_tokens - 1, 1)


def allowed(row: list[int]) -> set[int]:
    return {t for t in range(VOCAB) if (row[t // 32] >> (t % 32)) & 1}


def test_masks_follow_the_tokens(tokenizers):
    hf, tok = tokenizers
    masks = GrammarMasks(tok, torch.device("cpu"), threads=1)
    text = hf.encode("Hello, world!", add_special_tokens=False)
    grammar = choice_grammar(["Hello, world!", "How are you today?"])
    seq, free = constrained_seq(grammar), constrained_seq(None)
    seen = []
    for k in range(len(text) + 1):
        bitmask, rows = masks.masks([decode_item(free), decode_item(seq)])
        assert rows.tolist() == [1]  # only the constrained row
        ok = allowed(bitmask[0].tolist())
        seen.append(ok)
        if k < len(text):
            assert text[k] in ok
            seq.token_ids.append(text[k])
        else:
            assert ok == {hf.eos_token_id}  # complete: only end-of-sequence
        free.token_ids.append(3)
    # preempted and recomputed (tokens kept): the state is the one it had
    seq.token_ids.pop()
    bitmask, _ = masks.masks([decode_item(seq)])
    assert allowed(bitmask[0].tolist()) == seen[len(text) - 1]
    # tokens taken back: replayed from the start
    del seq.token_ids[seq.num_prompt_tokens + 1:]
    bitmask, _ = masks.masks([decode_item(seq)])
    assert allowed(bitmask[0].tolist()) == seen[1]
    # finished: not masked, and its matcher is dropped
    seq.status = SequenceStatus.FINISHED
    assert masks.masks([decode_item(seq)]) is None
    assert len(masks) == 0


def test_tokens_known(tokenizers):
    seq = constrained_seq(choice_grammar(["a"]))
    seq.num_pending = 1  # a step in flight samples its next token
    it = ScheduledSeq(seq, seq.num_tokens, 1)  # the step after: its input is the pending token
    assert GrammarMasks.constrained([it]) and not GrammarMasks.tokens_known([it])
    seq.token_ids.append(9)
    seq.num_pending = 0
    assert GrammarMasks.tokens_known([it])


def test_multistep_falls_back_to_one_step():
    from kvcache.block_manager import BlockManager
    from scheduler.policy import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(8, 64, 256, False, 0.0, 4), BlockManager(64, 4, False))
    for grammar in (None, choice_grammar(["yes", "no"])):
        seq = Sequence(next_seq_id(), [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, grammar=grammar))
        seq.token_ids.append(4)
        seq.num_computed_tokens = 3
        seq.block_table = sched.bm.admit([], 4)
        seq.status = SequenceStatus.RUNNING
        sched.running = [seq]
        batch = sched.schedule()
        assert batch.num_steps == (1 if grammar else 4)
        sched.bm.free(seq.block_table)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.models import build_model

    return build_model("llama", tmp_path_factory.mktemp("grammar-model") / "llama")


def test_async_scheduling_same_constrained_tokens(model_dir):
    """Masks filled after the launch (async scheduling: finish() once the previous token is known)
    give the tokens of one step at a time; every output is in its grammar; unconstrained rows in
    the same steps are as without them."""
    from serve import LLM

    pattern = r"[a-z]{2,6}( [0-9]{1,3}){2}"
    choices = ["Paris", "Berlin is far", "Tokyo"]
    params = [SamplingParams(max_tokens=40, temperature=0, grammar=regex_grammar(pattern)),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, grammar=regex_grammar(pattern)),
              SamplingParams(max_tokens=40, temperature=0.9, seed=5, grammar=choice_grammar(choices)),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    prompts = [[5 + i, 40, 41, 42 + i] for i in range(len(params))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling, num_kv_blocks=64)
        assert llm.engine.runner.overlap is async_scheduling
        outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]  # one at a time
        together = llm.generate(prompts, params)  # in one batch
        assert [o.token_ids for o in together] == [o.token_ids for o in outs]
        results.append([(o.token_ids, o.finish_reason) for o in together])
        for o in together[:2]:
            assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text
        assert together[2].text in choices and together[2].finish_reason == "stop"
        assert len(together[3].token_ids) == 12
        assert len(llm.engine.runner.grammar) <= len(params)  # finished ones dropped at the next fill
    assert results[0] == results[1]


def test_preempted_constrained_sequences_keep_their_grammar(model_dir):
    """A cache too small for every sequence preempts some (recomputed later, tokens kept): their
    matchers stay in step, and the outputs are those of a cache with room for all."""
    from serve import LLM

    pattern = r"[a-z ]{30,60}\."
    params = [SamplingParams(max_tokens=70, temperature=0.9, seed=i, grammar=regex_grammar(pattern)) for i in range(4)]
    prompts = [[5 + i] * 20 for i in range(4)]
    outs = {}
    for blocks in (64, 10):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", async_scheduling=True, num_kv_blocks=blocks,
                  block_size=16)
        results = llm.generate(prompts, params)
        outs[blocks] = [(o.token_ids, o.finish_reason) for o in results]
        for o in results:
            assert re.fullmatch(pattern, o.text), o.text
        preemptions = llm.engine.core.stats.num_preemptions
    assert preemptions > 0
    assert outs[10] == outs[64]


@pytest.mark.gpu
def test_constrained_on_the_gpu(model_dir):
    """On a GPU: masks applied to the decode graphs' logits (outside the graphs), with async
    scheduling and multi-step rounds (one step per round while constrained rows run): every output in
    its grammar, the same tokens with and without async scheduling."""
    from serve import LLM

    pattern = r"[a-z]{2,6}( [0-9]{1,3}){2}"
    params = [SamplingParams(max_tokens=40, temperature=0, grammar=regex_grammar(pattern)),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, grammar=regex_grammar(pattern)),
              SamplingParams(max_tokens=40, temperature=0, grammar=choice_grammar(["Paris", "Berlin is far"])),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    prompts = [[5 + i, 40, 41, 42 + i] for i in range(len(params))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), device="cuda", async_scheduling=async_scheduling, num_scheduler_steps=4,
                  max_num_seqs=8, num_kv_blocks=64)
        outs = llm.generate(prompts, params)
        for o in outs[:2]:
            assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text
        assert outs[2].text in ("Paris", "Berlin is far")
        assert len(outs[3].token_ids) == 24
        results.append([o.token_ids for o in outs])
        llm.shutdown()
    assert results[0] == results[1]


def test_end_of_sequence_ids_past_the_vocabulary_are_left_out(tokenizers):
    """A config's end-of-sequence id beside a smaller tokenizer (the benchmark folders: Llama-3's
    128001 with a 49,152-token vocabulary) is never sampled; llguidance refused it, which failed the
    vocabulary's build on start-up with a traceback in the log."""
    hf, _ = tokenizers
    t = GrammarTokenizer(hf, VOCAB, [hf.eos_token_id, 128001])
    assert t.eos_token_ids == [hf.eos_token_id] and t.get() is not None
    assert GrammarTokenizer(hf, VOCAB, [128001]).eos_token_ids == [hf.eos_token_id]
