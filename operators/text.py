"""Text in prompts, tokenized exactly and safely: the tokenizer split in two, chat templates rendered once, and the
prompt text of one user written out directly.

A `transformers` tokenizer first cuts its added tokens (special or not: `<|im_end|>`, `<think>`, `<a_12>`) out of
the text, then normalises, pre-tokenises and encodes every remaining span on its own. genrec-batch keeps that for the
template's own text and for the columns a template trusts, and never matches added tokens in other text from data: a
profile, a title or a query holding `<|im_end|>` or `<a_12>` stays text. So a prompt's ids are its atoms (added
tokens of the template's text, code tokens, BOS) and between them spans of text, each encoded by the tokenizer's
pipeline without its added tokens (`TextTokenizer.plain`), as the start of the text or as text after an added token
(`TextTokenizer.after`: a SentencePiece-style pre-tokenizer writes its "▁" at the very start only). On text from
data free of added tokens that is exactly the tokenizer on the whole text (`operators.prompts.Renderer.compile` checks
it on probes).

A chat template (jinja, in `transformers`' sandboxed environment) is rendered once per template with a sentinel in
place of each placeholder (`chat_skeleton`); the data never steers the template (a profile that starts with
`<tool_response>` cannot change which turn Qwen3's template treats as the question). Templates that change message
content (trim it, rewrite it) are refused: the sentinels must come through whole, whitespace around them included.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import re
import threading
from pathlib import Path

from decoding.templates import Field, PromptTemplate, parse

BREAK = "break"  # a boundary the template tokenizes across never (the instruction's end)
DATA, TRUSTED = ("\U000f0010", "\U000f0011"), ("\U000f0012", "\U000f0013")  # `prompt_pieces`' markers
SENTINEL = ("\U000f0000", "\U000f0001")  # `chat_skeleton`'s
AFTER = "\U000f0020"  # `TextTokenizer.after`'s added token


class TextTokenizer:
    """A fast tokenizer as two: `full`, its backend (the template's text, trusted fields), and `plain`, the same
    pipeline without any added token (text from data, every span between atoms)."""

    def __init__(self, tokenizer):
        from tokenizers import AddedToken, Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{type(tokenizer).__name__}: prompts are rendered with a fast tokenizer (tokenizer.json); this one "
                "has none"
            )
        raw = json.loads(backend.to_str())
        raw["added_tokens"] = []
        self.full, self.plain = backend, Tokenizer.from_str(json.dumps(raw))
        self.after = Tokenizer.from_str(json.dumps(raw))  # `plain` with one added token, AFTER: text that follows it
        self.after.add_special_tokens([AddedToken(AFTER, normalized=False)])
        for t in (self.plain, self.after):
            t.no_padding()
            t.no_truncation()
        self.added = set(tokenizer.added_tokens_decoder)  # every added token's id

    def atoms(self, text: str) -> list[str | int]:
        """Text the template (or a trusted field) writes -> its parts: text (str) and the added tokens the
        tokenizer matches in it (their ids), in order; the parts of text hold no added token."""
        enc = self.full.encode(text, add_special_tokens=False)
        out, at = [], 0
        for token, (a, b) in zip(enc.ids, enc.offsets):
            if token in self.added:
                out += [text[at:a]] * (a > at) + [token]
                at = b
        return out + [text[at:]] * (at < len(text))

    def reads_as_tokens(self, tokens: dict[int, str]) -> list[str]:
        """Tokens {id: text} -> the texts that `plain` still turns into their own token: a vocabulary that holds them
        as words (a word-level one over `<a_12>`), where text from data could write them."""
        ids = list(tokens)
        return [tokens[i] for i, got in zip(ids, self.encode([tokens[i] for i in ids])) if i in got]

    def encode(self, texts: list[str], leading: bool = True) -> list[list[int]]:
        """Spans of text, each tokenized as text (no added token matched) -> their ids; `leading`: each starts the
        text the tokenizer is given, else each follows an added token, which a pre-tokenizer may tell apart (a
        SentencePiece-style `Metaspace` with prepend_scheme "first" adds its "▁" at the very start only)."""
        if not texts:
            return []
        if leading:
            return [e.ids for e in self.plain.encode_batch_fast(texts, add_special_tokens=False)]
        return [e.ids[1:] for e in self.after.encode_batch_fast([AFTER + t for t in texts], add_special_tokens=False)]

    def encode_spans(self, spans: list[list[tuple[str, bool]]], leading: bool = True) -> list[list[int]]:
        """Spans given as parts (text, trusted) -> their ids: untrusted parts as text; a trusted part's added tokens
        matched (`atoms`) and the text between them tokenized with its neighbours, as the tokenizer would."""
        if not any(trusted for span in spans for _, trusted in span):
            return self.encode(["".join(text for text, _ in span) for span in spans], leading)
        return [self._span(span, leading) for span in spans]

    def _span(self, parts: list[tuple[str, bool]], leading: bool) -> list[int]:
        """One span with trusted parts -> its ids (atoms cut out of the trusted parts, the text around them joined)."""
        texts, atoms = [""], []  # texts[i] comes before atoms[i]
        for value, trusted in parts:
            for p in self.atoms(value) if trusted and value else [value]:
                if isinstance(p, str):
                    texts[-1] += p
                else:
                    atoms.append(p)
                    texts.append("")
        ids = self.encode(texts[:1], leading) + self.encode(texts[1:], leading=False)
        return [*itertools.chain.from_iterable([*span, *atoms[i : i + 1]] for i, span in enumerate(ids))]


def chat_template_text(template: PromptTemplate, tokenizer, model_dir) -> str | None:
    """The chat template a template's messages are written with: the file `template.chat_template` in the model
    directory, else the tokenizer's own; None for a plain template. Refused, naming the fix, when there is none."""
    if not template.messages:
        return None
    if template.chat_template:
        path = Path(model_dir or ".") / template.chat_template
        if not path.is_file():
            raise ValueError(
                f"prompt template {template.name!r}: chat template {template.chat_template} not found in the model "
                f"directory {model_dir}; put the file there (it is part of the model: hashed and uploaded with it)"
            )
        return path.read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt template {template.name!r}: the tokenizer has no chat template; name a jinja file in the model "
            "directory (chat_template)"
        )
    return tokenizer.chat_template


CHAT_RENDER_S = 30.0  # what rendering a chat template once may take (a few ms for any real one)


class RenderStopped(Exception):
    """Raised inside a chat template's render that ran past its deadline."""


def _stop(thread: threading.Thread, wait_s: float = 5.0) -> bool:
    """Stop a thread at its next bytecode with `RenderStopped` (a jinja template is Python code, so its loops stop
    there); True once it has ended. Nothing is left spinning in the process: a refused template costs no core."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RenderStopped))
    thread.join(wait_s)
    return not thread.is_alive()


def render_chat(tokenizer, chat: str, messages: list[dict], kwargs: dict, deadline_s: float = CHAT_RENDER_S) -> str:
    """Messages -> the chat template's text with the generation prompt (transformers' sandboxed jinja: no attribute
    escapes, but loops are its own). A template that has not rendered after `deadline_s` (a loop that does not end)
    is stopped and refused, naming it, rather than holding the run."""
    out: dict = {}

    def render():
        try:
            out["text"] = tokenizer.apply_chat_template(
                messages, chat_template=chat, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except RenderStopped:
            pass
        except Exception as e:  # noqa: BLE001 -- jinja's errors: the template's own, named below
            out["error"] = e

    worker = threading.Thread(target=render, name="chat-template", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        stopped = _stop(worker)
        raise ValueError(
            f"the chat template did not render within {deadline_s:g} s (a loop that does not end?)"
            + ("" if stopped else "; its render is still running (stuck outside Python code)")
        )
    if "error" in out:
        e = out["error"]
        raise ValueError(f"the chat template does not render these messages: {type(e).__name__}: {e}") from None
    return out["text"]


def chat_skeleton(template: PromptTemplate, tokenizer, chat: str) -> list[str | Field]:
    """A chat template rendered once, with a sentinel for each placeholder -> its parts: text and the placeholders,
    in order. Rendered three times (two sentinel shapes, and sentinels padded with whitespace); refused unless every
    placeholder comes through once, whole, in order, the text around it the same each time."""
    fields = [p for m in template.messages for p in parse(m["content"]) if isinstance(p, Field)]
    bare = lambda i: f"{SENTINEL[0]}{i}{SENTINEL[1]}"  # noqa: E731
    shapes = [  # (what the content holds, what the split looks for)
        (bare, bare),
        ((lambda i: f"{SENTINEL[0]}{'x' * (i + 2)}-{i}{SENTINEL[1]}"),) * 2,
        (lambda i: f" \n\t{bare(i)}\n ", bare),
    ]
    found = [_split_render(template, tokenizer, chat, fields, *shape) for shape in shapes]
    last = len(found[2]) - 1
    unpadded = [p if not isinstance(p, str) else _unpad(p, i > 0, i < last) for i, p in enumerate(found[2])]
    if not (found[0] == found[1] == unpadded) or [p for p in found[0] if isinstance(p, Field)] != fields:
        raise ValueError(
            f"prompt template {template.name!r}: the chat template changes message content (it trims, reorders or "
            "rewrites it), so data cannot be placed in it exactly; use a chat template that writes content as given"
        )
    return [*found[0], template.generation_prefix] if template.generation_prefix else found[0]


def _unpad(text: str, after: bool, before: bool) -> str | None:
    """A text part between padded sentinels (`after` one, `before` one) without their padding; None when it is not
    there (the template changed the content)."""
    head, tail = "\n " * after, " \n\t" * before
    if not (text.startswith(head) and text.endswith(tail)) or len(text) < len(head) + len(tail):
        return None
    return text[len(head) : len(text) - len(tail)]


def _split_render(template: PromptTemplate, tokenizer, chat: str, fields: list[Field], shape, find) -> list:
    """The messages rendered with `shape(i)` for the i-th placeholder, split where `find(i)` is -> text parts and
    placeholders (a text part between two placeholders kept even when empty: every render has the same layout)."""
    counter = itertools.count()
    messages = [
        {
            "role": m["role"],
            "content": "".join(p if isinstance(p, str) else shape(next(counter)) for p in parse(m["content"])),
        }
        for m in template.messages
    ]
    text = render_chat(tokenizer, chat, messages, template.chat_template_kwargs)
    out, at = [], 0
    for i, f in enumerate(fields):
        s = find(i)
        k = text.find(s, at)
        if k < 0 or text.count(s) != 1:
            return [None]
        out += [text[at:k], f]
        at = k + len(s)
    return [*out, text[at:]]


def prompt_pieces(
    template: PromptTemplate,
    tokenizer,
    chat: str | None,
    histories: dict[str, list[str]],
    users: dict[str, str],
) -> list[tuple[str, str]]:
    """One user's prompt written out directly, the slow way (a reference and the compile-time check): `histories`
    {column: its written items, each `template.item_text` with its catalog values marked by `mark`}, `users` {column:
    the text written} -> the prompt as pieces (text, kind): "template" text, "data" and "trusted" text from data,
    `BREAK` between the instruction and the rest, "bos". A chat template renders the messages with the values in
    place (marked, then the marks split out)."""

    def value(p: str | Field) -> str:
        if isinstance(p, str):
            return p
        if p.kind == "history":
            return template.separator.join(histories.get(p.column, []))
        return mark(users.get(p.column, ""), p.column in template.trusted)

    bos = [("", "bos")] if template.uses_bos(tokenizer) else []
    if chat is not None:
        messages = [{"role": m["role"], "content": "".join(map(value, parse(m["content"])))} for m in template.messages]
        text = render_chat(tokenizer, chat, messages, template.chat_template_kwargs) + template.generation_prefix
        return bos + unmark(text)
    instruction = unmark("".join(map(value, parse(template.instruction)))) if template.instruction else []
    rest = "".join(map(value, parse(template.prefix))) + value(Field("history", "history"))
    rest += "".join(map(value, parse(template.suffix)))
    return bos + instruction + [("", BREAK)] * bool(instruction) + unmark(rest)


def mark(value: str, trusted: bool) -> str:
    """A value from data, marked for `unmark` (its kind: trusted or not)."""
    a, b = TRUSTED if trusted else DATA
    return f"{a}{value}{b}" if value else ""


_MARKS = re.compile(f"{DATA[0]}(.*?){DATA[1]}|{TRUSTED[0]}(.*?){TRUSTED[1]}", re.S)


def unmark(text: str) -> list[tuple[str, str]]:
    """Text with marked values -> pieces (text, "template" | "data" | "trusted"), empty ones left out."""
    out, at = [], 0
    for m in _MARKS.finditer(text):
        out += [
            (text[at : m.start()], "template"),
            (m.group(1), "data") if m.group(1) is not None else (m.group(2), "trusted"),
        ]
        at = m.end()
    return [p for p in [*out, (text[at:], "template")] if p[0]]


def library_ids(pieces: list[tuple[str, str]], tokenizer) -> list[int]:
    """The tokenizer's own ids of a prompt's pieces (`prompt_pieces`): BOS, then the text, the instruction apart;
    added tokens matched everywhere (what the model's tokenizer does to the whole text: equal to the rendered ids when
    the data holds no added token)."""
    ids, text = [], ""
    for piece, kind in [*pieces, ("", BREAK)]:
        if kind == "bos":
            ids.append(tokenizer.bos_token_id)
        elif kind == BREAK:
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            text = ""
        else:
            text += piece
    return ids
