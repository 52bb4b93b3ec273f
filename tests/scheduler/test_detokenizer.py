"""Incremental detokenization: deltas concatenate to the full decode; stop strings are held back."""
from scheduler.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Each id is one UTF-8 byte: multi-byte characters span several ids."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text, stop=(), tok=ByteTokenizer(), include_stop=False, min_tokens=0):
    d = IncrementalDetokenizer(tok, list(stop), include_stop=include_stop, min_tokens=min_tokens)
    ids = list(text.encode())
    deltas = [d.add([i], final=(k == len(ids) - 1)) for k, i in enumerate(ids)]
    return deltas, d


def test_multibyte_characters_are_never_split():
    text = "naïve 北京 🚀!"
    deltas, _ = feed(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_and_partial_matches_are_held_back():
    deltas, d = feed("hello STOP world", stop=["STOP"])
    assert d.stopped and "".join(deltas) == "hello "
    deltas, d = feed("a ST b", stop=["STOP"])  # a partial match that never completes is released
    assert not d.stopped and "".join(deltas) == "a ST b"
    assert "".join(deltas[:4]) == "a "  # "S", "ST" held while they could start "STOP"


def test_earliest_of_several_stop_strings_wins():
    deltas, d = feed("xx END yy STOP", stop=["STOP", "END"])
    assert "".join(deltas) == "xx "


def test_min_tokens_lets_stop_strings_count_only_after_them():
    """vLLM's rule: a stop string ends the output only from the (min_tokens + 1)-th token on, and only
    where it ends in text decoded from then on (what could start one is held back all along)."""
    deltas, d = feed("ab STOP cd STOP ef", stop=["STOP"], min_tokens=8)  # the first STOP ends at token 7
    assert d.stopped and "".join(deltas) == "ab STOP cd "
    deltas, d = feed("ab STOP cd", stop=["STOP"], min_tokens=6)  # its last byte is token 7: it counts
    assert d.stopped and "".join(deltas) == "ab "
    deltas, d = feed("ab STOP cd", stop=["STOP"], min_tokens=7)
    assert not d.stopped and "".join(deltas) == "ab STOP cd"


def test_include_stop_keeps_the_stop_string_found_first():
    """include_stop_str_in_output: the text ends after the stop string; of several, the earliest,
    and of those starting at one place, the longest."""
    deltas, d = feed("hello STOP world", stop=["STOP"], include_stop=True)
    assert d.stopped and "".join(deltas) == "hello STOP"
    deltas, _ = feed("xx END yy STOP", stop=["STOP", "END"], include_stop=True)
    assert "".join(deltas) == "xx END"
    deltas, _ = feed("a ENDING b", stop=["END", "ENDING"], include_stop=True)
    assert "".join(deltas) == "a END"  # "END" completes first; the text stops as soon as a stop string is whole


def test_byte_table_fast_path_equals_tokenizer_decode(tiny_models):
    import random

    from transformers import AutoTokenizer

    from scheduler.token_bytes import token_bytes_table

    tok = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    rng = random.Random(0)
    for skip in (True, False):
        table = token_bytes_table(tok, skip)
        assert table is not None
        for _ in range(100):
            ids = [rng.randrange(len(table)) for _ in range(rng.randrange(1, 30))]
            d = IncrementalDetokenizer(tok, [], skip, table)
            text = "".join(d.add([i], final=k == len(ids) - 1) for k, i in enumerate(ids))
            assert text == tok.decode(ids, skip_special_tokens=skip)


def test_token_id_tokenizer_table_gives_the_decoded_text():
    from scheduler.token_bytes import token_bytes_table
    from serve.build import TokenIdTokenizer

    assert token_bytes_table(TokenIdTokenizer()) is None  # vocabulary size unknown: decode() it is
    tok = TokenIdTokenizer(vocab_size=500)
    table = token_bytes_table(tok)
    ids = [0, 7, 499, 42, 42]
    d = IncrementalDetokenizer(tok, [], True, table)
    assert "".join(d.add([i], final=k == len(ids) - 1) for k, i in enumerate(ids)) == tok.decode(ids)
