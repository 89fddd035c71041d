"""Stop strings whose characters take several byte-level tokens (emoji, CJK, accented runs).

A byte-level BPE tokenizer is trained here on a small generated corpus with a vocabulary small
enough that most non-ASCII characters stay split over 2-4 tokens. StopChecker is compared with
a naive reference that decodes the whole output after every token.
"""

import copy
import random

import pytest
from helpers import run_checked
from models import tiny_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.engine.stop import StopChecker
from rollout.requests.sequence import Sequence

MAX_MODEL_LEN = 4096
ASCII = "abcdefghijklmnopqrstuvwxyz0123456789 .,+="
# Many distinct characters, each too rare for the few merges to cover it: most stay split.
ACCENTED = "àáâãäåçèéêëìíîïñòóôõöùúûüýÿœæ" + "".join(map(chr, range(0x100, 0x180, 2)))
CJK = "中文日本語你好世界天地人山水火木金土月星雨風雲花鳥魚" + "".join(
    chr(0x4E00 + 331 * k) for k in range(60))
EMOJI = "🙂🚀🔥👍🎉🌍💡😀🐍🍕🌸⭐" + "".join(chr(0x1F300 + 13 * k) for k in range(60))
SPECIALS = ["<pad>", "<eos>", "<sep>"]


def _words(rng: random.Random) -> str:
    pools = [ASCII[:26], ACCENTED, CJK, EMOJI]
    return " ".join("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 5)))
                    for _ in range(rng.randint(3, 12)))


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [_words(rng) for _ in range(300)] + ["hello world, café naïve 1+2=3"] * 50
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=340, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>",
                                   sep_token="<sep>")


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make_seq(prompt, output=(), stop=(), max_tokens=1000, stop_ids=frozenset()):
    return Sequence(seq_id=0, group="g", sample_index=0, prompt_ids=list(prompt),
                    params=SamplingParams(stop=list(stop), max_tokens=max_tokens), seed=0,
                    stop_ids=frozenset(stop_ids), token_ids=list(prompt) + list(output))


def naive(tok, seq, tokens):
    """The reference: decode the whole output after every token."""
    out = seq.output_ids
    for kept, token in enumerate(tokens, 1):
        out = out + [token]
        if token in seq.stop_ids:
            return kept, "stop", None
        text = tok.decode(out, skip_special_tokens=True)
        found = [text.find(s) for s in seq.params.stop if s in text]
        if found:
            return kept, "stop", min(found)
        if len(out) >= seq.params.max_tokens or seq.num_prompt + len(out) >= MAX_MODEL_LEN:
            return kept, "length", None
    return len(tokens), None, None


def state(seq):
    return copy.deepcopy({k: v for k, v in vars(seq).items() if k != "params"})


def step_by_step(checker, seq, tokens):
    """What the engine does without drafts: check one token, append it, stop at a reason."""
    for kept, token in enumerate(tokens, 1):
        _, reason, at = checker.check(seq, [token])
        seq.token_ids.append(token)
        if reason is not None:
            return kept, reason, at
    return len(tokens), None, None


def speculative(checker, seq, tokens, rng):
    """What the engine does when verifying drafts: check a few tokens at once, keep `kept`."""
    pos = 0
    while pos < len(tokens):
        chunk = tokens[pos:pos + rng.randint(1, 5)]
        kept, reason, at = checker.check(seq, chunk)
        seq.token_ids += chunk[:kept]
        pos += kept
        if reason is not None:
            return pos, reason, at
    return pos, None, None


def agrees(tok, tokens, stop, prompt=(5,), max_tokens=1000, stop_ids=(), rng=None):
    """check() == naive reference, from the empty output and from a committed prefix that has
    not stopped yet (every one, or one drawn by `rng`), also a few tokens at a time; and one
    token by token agrees; check() leaves the sequence alone."""
    checker = StopChecker(MAX_MODEL_LEN, tok)

    def fresh(output=()):
        return make_seq(prompt, output, stop, max_tokens, stop_ids)

    seq = fresh()
    ref = naive(tok, seq, tokens)
    before = state(seq)
    assert checker.check(seq, tokens) == ref
    assert state(seq) == before
    for k in range(ref[0]) if rng is None else [rng.randrange(ref[0])]:
        committed = fresh(tokens[:k])
        before = state(committed)
        assert checker.check(committed, tokens[k:]) == (ref[0] - k,) + ref[1:], k
        assert state(committed) == before
    assert speculative(checker, fresh(), tokens, rng or random.Random(0)) == ref
    assert step_by_step(checker, fresh(), tokens) == ref
    return ref


def counted(tok):
    """`tok`, and the lengths of the token lists it is asked to decode."""
    lengths = []

    class Counting:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tok.decode(ids, **kw)

    return Counting(), lengths


def split_chars(tok, text):
    """The characters of `text` that its encoding spreads over several tokens."""
    return {c for c in text if len(enc(tok, c)) > 1}


def test_tokenizer_splits_multibyte_characters(tok):
    assert 300 <= len(tok) <= 400
    for pool in (ACCENTED, CJK, EMOJI):
        assert len(split_chars(tok, pool)) >= len(pool) // 2, pool


@pytest.mark.parametrize("text,stop", [
    ("ok 🙂 then 🚀🔥 more", "🚀🔥"),                  # emoji
    ("abc 中文 日本語 天地人 xyz", "本語 天"),          # CJK
    ("les crème brûlée àéîõü fin", "àéîõü"),          # run of accented letters
    ("say hello🐍🍕 and go", "o🐍🍕 a"),               # ASCII and emoji mixed
    ("x " + EMOJI[:12] + CJK[:26] + " end", EMOJI[2:12] + CJK[:9]),  # longer than a short window
], ids=["emoji", "cjk", "accented", "mixed", "long"])
def test_multibyte_stop_strings(tok, text, stop):
    tokens = enc(tok, text)
    assert len(tokens) > len(text.replace(" ", "")) // 2 and split_chars(tok, stop)
    kept, reason, at = agrees(tok, tokens, [stop])
    assert reason == "stop" and at == text.index(stop)
    assert tok.decode(tokens[:kept]).endswith(stop)  # fires at the token that completes it
    assert stop not in tok.decode(tokens[:kept - 1])


def test_earliest_stop_string_wins(tok):
    text = "go a🚀🔥b 中文"
    stops = ["中文", "🔥", "a🚀🔥"]  # the last two complete at the same token
    kept, reason, at = agrees(tok, enc(tok, text), stops)
    assert reason == "stop" and at == text.index("a🚀🔥")
    assert tok.decode(enc(tok, text)[:kept]) == "go a🚀🔥"


def test_stop_string_spanning_a_skipped_special_token(tok):
    sep = tok.sep_token_id
    emoji = enc(tok, "🙂")
    assert len(emoji) >= 2
    # The special token sits between ASCII and the emoji, and inside the emoji's bytes.
    tokens = enc(tok, "ab") + [sep] + emoji[:1] + [sep] * 3 + emoji[1:] + enc(tok, "cd")
    assert tok.decode(tokens, skip_special_tokens=True) == "ab🙂cd"
    assert agrees(tok, tokens, ["b🙂c"])[1:] == ("stop", 1)
    # "sep" is only in the special token's own text, which the caller never sees.
    assert agrees(tok, tokens, ["sep", "<sep>"])[1:] == (None, None)


def test_no_match_until_the_character_is_complete(tok):
    checker = StopChecker(MAX_MODEL_LEN, tok)
    for char in ("🔥", "語", "õ"):
        pieces = enc(tok, char)
        assert len(pieces) >= 2, char
        seq = make_seq([7], enc(tok, "x "), [char, "\u00e9x"])
        for piece in pieces[:-1]:
            assert checker.check(seq, [piece]) == (1, None, None)
            seq.token_ids.append(piece)
        assert checker.check(seq, [pieces[-1]]) == (1, "stop", 2)


def test_replacement_character_in_a_stop_string(tok):
    """U+FFFD is what the caller sees of a character cut short: it matches right after the
    token that cuts it, even though the next token would complete the character."""
    pieces = enc(tok, "🔥")
    tokens = enc(tok, "a ") + pieces + enc(tok, " b")
    assert agrees(tok, tokens, [" \ufffd"])[:2] == (len(enc(tok, "a ")) + 1, "stop")
    assert agrees(tok, tokens, ["\ufffd b"])[1:] == (None, None)
    # A window that starts inside the emoji decodes its bytes there to U+FFFD: not the text,
    # so no match, nor a decode of the whole output to look for one.
    tokens = enc(tok, "c") * 20 + enc(tok, "🔥") + enc(tok, "ab") + enc(tok, "c") * 20
    assert agrees(tok, tokens, ["\ufffdab", "\ufffd\ufffd"])[1:] == (None, None)
    counting, lengths = counted(tok)
    seq = make_seq([5], (), ["\ufffdab", "\ufffd\ufffd"])
    assert step_by_step(StopChecker(MAX_MODEL_LEN, counting), seq, tokens)[1:] == (None, None)
    assert max(lengths) <= 20


def test_check_several_tokens_at_once(tok):
    """Speculative decoding emits accepted drafts plus one: `kept` counts up to the stop."""
    checker = StopChecker(MAX_MODEL_LEN, tok)
    head, fire = enc(tok, "hi 天"), enc(tok, "地🙂")
    seq = make_seq([1, 2], head, ["天地🙂"])
    tokens = fire + enc(tok, " more 中文")
    before = state(seq)
    assert checker.check(seq, tokens) == (len(fire), "stop", 3)
    assert state(seq) == before
    assert checker.check(seq, fire[:-1]) == (len(fire) - 1, None, None)
    # At one token: a stop id and a stop string it completes both stop there, the string's
    # text cut; either before max_tokens.
    limited = make_seq([1, 2], head, ["天地🙂"], max_tokens=len(head) + len(fire),
                       stop_ids={fire[-1]})
    assert checker.check(limited, tokens) == (len(fire), "stop", 3)
    limited = make_seq([1, 2], head, ["天地🙂"], max_tokens=len(head) + len(fire))
    assert checker.check(limited, tokens) == (len(fire), "stop", 3)
    limited.params.max_tokens -= 1
    assert checker.check(limited, tokens) == (len(fire) - 1, "length", None)
    assert checker.check(limited, []) == (0, None, None)


def test_random_sequences_match_the_naive_reference(tok):
    rng = random.Random(1)
    specials = [tok.convert_tokens_to_ids(s) for s in SPECIALS]
    fired = 0
    for case in range(300):
        if case % 2:  # any tokens at all: stray and truncated bytes decode to U+FFFD
            tokens = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        else:
            tokens = enc(tok, _words(rng))[:60]
            for _ in range(rng.randint(0, 3)):
                tokens.insert(rng.randint(0, len(tokens)), rng.choice(specials))
        text = tok.decode(tokens, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(max(len(text), 1))
            stops.append(text[i:i + rng.randint(1, 8)] or rng.choice(EMOJI))
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 4))]
        ref = agrees(tok, tokens, stops, prompt, max_tokens=rng.choice([1000, len(tokens)]),
                     rng=rng)
        fired += ref[1] == "stop"
    assert fired > 200


def test_window_stays_short(tok):
    """Each check decodes a short window; the whole output once, on a match."""
    counting, lengths = counted(tok)
    checker = StopChecker(MAX_MODEL_LEN, counting)
    tokens = enc(tok, " ".join(_words(random.Random(i)) for i in range(40)))[:1000]
    assert len(tokens) == 1000
    stop = "🙂🚀🔥👍🎉"  # not in the output
    seq = make_seq([1], (), [stop], max_tokens=2000)
    assert step_by_step(checker, seq, tokens) == (1000, None, None)
    assert max(lengths) <= 40 and len(lengths) < 2 * len(tokens)
    lengths.clear()
    assert speculative(checker, make_seq([1], (), [stop], max_tokens=2000), tokens,
                       random.Random(0)) == (1000, None, None)
    assert max(lengths) <= 64 and len(lengths) < len(tokens) / 2  # about one window a check
    lengths.clear()
    seq = make_seq([1], tokens, [stop], max_tokens=2000)
    fire = enc(tok, " " + stop)
    assert checker.check(seq, fire + enc(tok, " ok")) == (len(fire), "stop",
                                                         len(tok.decode(tokens)) + 1)
    assert [n for n in lengths if n > len(tokens)] == [len(tokens) + len(fire)]


def test_engine_stops_at_a_multibyte_stop_string(tok):
    model = tiny_model("llama", vocab_size=len(tok))
    engine = Engine(model, EngineConfig(kv_cache_tokens=1024, max_model_len=128), tokenizer=tok)
    for seed in range(20):
        params = dict(temperature=1.0, seed=seed, max_tokens=100, ignore_eos=True)
        free = run_checked(engine, ["hello 🙂"], SamplingParams(**params))[0].samples[0]
        text = free.text
        assert text == tok.decode(free.token_ids, skip_special_tokens=True)
        # A character the output spells over several tokens: a prefix of the output ends
        # halfway through it (decoded as U+FFFD there).
        prefixes = [tok.decode(free.token_ids[:i], skip_special_tokens=True)
                    for i in range(len(free.token_ids))]
        split = [p for p in range(1, len(text)) if "\ufffd" not in text[p - 1:p + 1] and any(
            prefix[p:p + 1] == "\ufffd" for prefix in prefixes)]
        if split:
            break
    else:
        pytest.fail("no sample spells a character over several tokens")
    p = split[0]
    stop = text[p - 1:p + 1]
    cut = run_checked(engine, ["hello 🙂"], SamplingParams(**params, stop=[stop]))[0].samples[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    assert cut.token_ids == free.token_ids[:len(cut.token_ids)]
