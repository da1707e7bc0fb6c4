"""Prompt templates: how a model's prompt is written, stored beside its `config.json` so that training and inference
always render the same prompt.

A plain template writes, for a history of n items (the last `max_items`, oldest first, numbered 1..n), the text

    prefix + item(1) + separator + item(2) + ... + separator + item(n) + suffix

where item(i) is `item` with `{index}` -> i and `{codes}` -> the item's L code tokens written back to back
(`<a_47><b_103><c_234><d_99>`, named by `code_token`: `{level}` is the level letter a, b, ..., `{level_index}` its
number 0, 1, ..., `{code}` the code). With `bos` the token ids start with the tokenizer's BOS token, as a tokenizer
that adds it itself (Llama's) does: the ids are `[bos] + tokenizer(text, add_special_tokens=False)` (`bos: "auto"`:
where the tokenizer has one, as MiniOneRec's data.py does; Qwen's has none). An `instruction` is text tokenized on its
own before that: the ids are `[bos] + tokenizer(instruction) + tokenizer(text)`, the two parts never merged across
their boundary (MiniOneRec's EvalSidDataset tokenizes its Alpaca instruction and the user input separately).

A chat template writes `messages` (role and content) through the model's chat template (the tokenizer's, or a jinja
file beside the model: `chat_template`), with `chat_template_kwargs` (`enable_thinking: false`) and the generation
prompt, then `generation_prefix` (OpenOneRec's `<|sid_begin|>`).

Placeholders (anything else in braces is text): `{history}` (the input's history, written item by item) and
`{history:COLUMN}` (another list-of-item-ids column, its window `windows[COLUMN]` items, else `max_items`),
`{user:COLUMN}` (a string or number column of the user's row) in the prefix, suffix, instruction or message contents;
`{codes}`, `{index}` and `{item:COLUMN}` (a column of the catalog: a title, a brand) in `item`. A null field writes
nothing (an empty text, a history of no items); the `history` column itself must hold an item (operators/validate.py).
Text from data is tokenized as text, never as the tokenizer's added tokens (a title holding `<|im_end|>` stays text),
except in the columns listed in `trusted`, which are parsed as the tokenizer parses them (OpenOneRec's profile with its
semantic IDs written in).

What the model writes after an item's codes: `answer_suffix` (text, e.g. "\n") and then EOS (`answer_eos`). Their
tokens are forced, one continuation per item, and their log-probabilities count in the item's score (MiniOneRec's
evaluate.py generates codes + "\n" + EOS with length_penalty 0, so its ranking includes them); empty and false, an
item's score is its codes' alone.

Presets: `codes` (the project's own format: `<bos>` + the code tokens of the last 20 items, nothing else), `lcrec`
(the LC-Rec / AtSpeed instruction prompt), `minionerec` (MiniOneRec's evaluation prompt and ranking) and `openonerec`
(OpenOneRec's video recommendation prompt; `openonerec:S:U` picks their S-th system and U-th user prompt). The file
`genrec_template.json` in a model directory holds one.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

TEMPLATE_FILE = "genrec_template.json"
PLACEHOLDER = re.compile(r"\{(history|user|item|codes|index)(?::([^{}]*))?\}")
WHERE = {  # which placeholders each part of a template may hold
    "text": ("history", "user"),
    "item": ("codes", "index", "item"),
}


class Field(NamedTuple):
    """A placeholder: `kind` history, user, item, codes or index; `column` the input's or the catalog's column
    (`history` for `{history}`, "" for codes and index)."""

    kind: str
    column: str = ""


def parse(text: str, where: str = "text", source: str = "template") -> list[str | Field]:
    """Text with placeholders -> its parts in order: text (str) and placeholders (Field); refused, naming it, when a
    placeholder has no place there (`WHERE`) or lacks its column (`{user}`), or a column is named where none is
    taken (`{codes:x}`)."""
    parts, at = [], 0
    for m in PLACEHOLDER.finditer(text):
        kind, column = m.group(1), m.group(2)
        if kind not in WHERE[where]:
            allowed = ", ".join(f"{{{k}}}" for k in WHERE[where])
            raise ValueError(f"{source}: {m.group(0)} has no place here (here: {allowed}; {{item:COLUMN}} in `item`)")
        if kind in ("user", "item") and not column:
            raise ValueError(f"{source}: {m.group(0)} names no column; write {{{kind}:COLUMN}}")
        if kind in ("codes", "index") and column is not None:
            raise ValueError(f"{source}: {m.group(0)} takes no column")
        parts += [text[at : m.start()]] * (m.start() > at) + [Field(kind, column or ("history" * (kind == "history")))]
        at = m.end()
    return parts + [text[at:]] * (at < len(text))


def as_text(column) -> list[str]:
    """A column of strings or numbers [B] -> each value as the prompt writes it [B] (numbers as Python writes them;
    a null: "", and a column of Arrow's null type, all nulls, writes nothing)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], column.type)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_null(column.type):
        return [""] * len(column)
    if not is_text(column.type):
        raise ValueError(f"a {column.type} column cannot be written as text (strings, integers, floats, booleans)")
    strings = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    return [("" if v is None else v if strings else str(v)) for v in column.to_pylist()]


def is_text(kind: pa.DataType) -> bool:
    """Can a column of this type fill a {user:...} or {item:...} placeholder? (Arrow's null type: a column of nulls
    only, as a block of a Ray Data or pandas column holds where every value is None, writes nothing.)"""
    t = pa.types
    if t.is_dictionary(kind):
        kind = kind.value_type
    kinds = (t.is_string, t.is_large_string, t.is_integer, t.is_floating, t.is_boolean, t.is_null)
    return any(is_kind(kind) for is_kind in kinds)


@dataclass(frozen=True)
class PromptTemplate:
    name: str = "custom"
    prefix: str = ""  # text before the history
    item: str = "{codes}"  # one history item; `{codes}` once, `{index}` and `{item:COLUMN}` optional
    separator: str = ""  # between two items
    suffix: str = ""  # text after the history
    max_items: int = 20  # the last max_items items of a history are written
    bos: bool | str = True  # the prompt's ids start with the tokenizer's BOS token ("auto": where it has one)
    code_token: str = "<{level}_{code}>"  # the name of the token of (level, code)
    instruction: str = ""  # text before the prefix, tokenized on its own (after BOS)
    answer_suffix: str = ""  # text the model writes after an item's codes: forced, scored
    answer_eos: bool = False  # then EOS: forced, scored
    messages: list = field(default_factory=list)  # chat messages [{"role", "content"}]: the model's chat template
    # writes them (then prefix, suffix and instruction stay empty)
    chat_template: str | None = None  # a jinja file in the model directory; None: the tokenizer's chat template
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to the chat template ({"enable_thinking": false})
    generation_prefix: str = ""  # text after the chat template's generation prompt (OpenOneRec: <|sid_begin|>)
    windows: dict = field(default_factory=dict)  # {COLUMN: items} for {history:COLUMN} (else max_items)
    trusted: list = field(default_factory=list)  # user or catalog columns parsed as the tokenizer parses them

    def __post_init__(self):
        if self.bos not in (True, False, "auto"):
            raise ValueError(f'prompt template {self.name!r}: bos must be true, false or "auto", got {self.bos!r}')
        if not isinstance(self.answer_eos, bool):
            raise ValueError(
                f"prompt template {self.name!r}: answer_eos must be true or false, got {self.answer_eos!r}"
            )
        if not isinstance(self.max_items, int) or self.max_items < 1:
            raise ValueError(
                f"prompt template {self.name!r}: max_items must be an integer >= 1, got {self.max_items!r}"
            )
        if "{code}" not in self.code_token or not ("{level}" in self.code_token or "{level_index}" in self.code_token):
            raise ValueError(
                f"prompt template {self.name!r}: code_token must contain {{code}} and {{level}} or "
                f"{{level_index}}, got {self.code_token!r}"
            )
        try:
            self.code_token.format(level="a", level_index=0, code=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt template {self.name!r}: bad placeholder in code_token ({e!r}); use {{level}}, "
                "{level_index}, {code}"
            ) from None
        self._check_item()
        self._check_chat()
        self._check_fields()

    def _check_item(self) -> None:
        where = f"prompt template {self.name!r}: `item`"
        if sum(p == Field("codes") for p in parse(self.item, "item", where)) != 1:
            raise ValueError(f"{where} must contain {{codes}} exactly once, got {self.item!r}")
        for name in ("separator", "answer_suffix", "generation_prefix"):
            if PLACEHOLDER.search(getattr(self, name)):
                raise ValueError(f"prompt template {self.name!r}: `{name}` is text, it holds no placeholder")

    def _check_chat(self) -> None:
        name = f"prompt template {self.name!r}"
        if not isinstance(self.messages, list) or not all(
            isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
            for m in self.messages
        ):
            raise ValueError(f'{name}: messages must be a list of {{"role": ..., "content": ...}} texts')
        if not self.messages:
            chat = [f for f in ("chat_template", "chat_template_kwargs", "generation_prefix") if getattr(self, f)]
            if chat:
                raise ValueError(f"{name}: {', '.join(chat)} only go with messages (a chat template)")
            return
        plain = [f for f in ("prefix", "suffix", "instruction") if getattr(self, f)]
        if plain:
            raise ValueError(f"{name}: with messages the prompt is the messages; {', '.join(plain)} must be empty")
        if self.bos is True:
            raise ValueError(f"{name}: with messages the chat template writes any BOS token itself; set bos to false")
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or Path(self.chat_template).name != self.chat_template
        ):
            raise ValueError(f"{name}: chat_template names a file in the model directory, got {self.chat_template!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"{name}: chat_template_kwargs must be an object, got {self.chat_template_kwargs!r}")

    def _check_fields(self) -> None:
        name = f"prompt template {self.name!r}"
        histories = [f.column for f in self.fields() if f.kind == "history"]
        repeated = sorted({c for c in histories if histories.count(c) > 1})
        if repeated:
            raise ValueError(f"{name}: each history is written once; {repeated} more often")
        if not isinstance(self.windows, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.windows.values()
        ):
            raise ValueError(f"{name}: windows must map history columns to item counts >= 1, got {self.windows!r}")
        unused = sorted(set(self.windows) - set(histories) | ({"history"} & set(self.windows)))
        if unused:
            raise ValueError(f"{name}: windows names {unused}, not a {{history:COLUMN}} of the template")
        read = {f.column for f in self.fields() if f.kind in ("user", "item")}
        if not isinstance(self.trusted, list) or set(self.trusted) - read:
            raise ValueError(
                f"{name}: trusted must list {{user:...}} or {{item:...}} columns of the template, got {self.trusted!r}"
            )

    def texts(self) -> list[tuple[str, str]]:
        """Every text part that may hold history and user placeholders, (where, text), in prompt order."""
        if self.messages:
            return [(f"messages[{i}].content", m["content"]) for i, m in enumerate(self.messages)]
        return [("instruction", self.instruction), ("prefix", self.prefix), ("suffix", self.suffix)]

    def fields(self) -> list[Field]:
        """Every placeholder of the template in prompt order ({history} between prefix and suffix in a plain
        template), codes and index left out."""
        out = []
        for where, text in self.texts():
            out += [p for p in parse(text, "text", f"prompt template {self.name!r}: {where}") if isinstance(p, Field)]
            if where == "prefix":
                out.append(Field("history", "history"))
        out += [p for p in parse(self.item, "item") if isinstance(p, Field) and p.kind == "item"]
        return out

    @property
    def histories(self) -> dict[str, int]:
        """{history column: its window} in prompt order; `history` is the input's history (decoding.history_len)."""
        return {
            f.column: self.max_items if f.column == "history" else self.windows.get(f.column, self.max_items)
            for f in self.fields()
            if f.kind == "history"
        }

    @property
    def user_columns(self) -> list[str]:
        """The input's columns written as text ({user:COLUMN}), in prompt order, each once."""
        return list(dict.fromkeys(f.column for f in self.fields() if f.kind == "user"))

    @property
    def item_columns(self) -> list[str]:
        """The catalog's columns written as text ({item:COLUMN}), each once."""
        return list(dict.fromkeys(f.column for f in self.fields() if f.kind == "item"))

    @property
    def input_columns(self) -> list[str]:
        """The input's columns a prompt reads besides `history`: other histories, then user fields."""
        return [c for c in self.histories if c != "history"] + [c for c in self.user_columns if c not in self.histories]

    def code(self, level: int, code: int) -> str:
        """(level 0, code 47) -> '<a_47>' by default."""
        if not 0 <= level < 26:
            raise ValueError(f"level must be in [0, 26), got {level}")
        return self.code_token.format(level=chr(ord("a") + level), level_index=level, code=code)

    def item_text(self, index: int, codes: str, values: dict | None = None) -> str:
        """`item` written for the item at 1-based `index` whose code tokens read `codes` and whose catalog values are
        `values` ({column: text})."""
        out = []
        for p in parse(self.item, "item"):
            out.append(
                p if isinstance(p, str) else codes if p.kind == "codes" else str(index) if p.kind == "index"
                else (values or {}).get(p.column) or ""
            )  # fmt: skip
        return "".join(out)

    def text(self, items: list[list[int]]) -> str:
        """The prompt text of a plain template without user or catalog fields, for a history given as the items'
        codes [[c_0, .., c_{L-1}], ...] (oldest first); only the last max_items are written."""
        items = items[-self.max_items :]
        written = [
            self.item_text(i + 1, "".join(self.code(j, c) for j, c in enumerate(codes)))
            for i, codes in enumerate(items)
        ]
        return self.instruction + self.prefix + self.separator.join(written) + self.suffix

    def uses_bos(self, tokenizer) -> bool:
        """Do this template's prompts start with the tokenizer's BOS token?"""
        return self.bos is True or (self.bos == "auto" and tokenizer.bos_token_id is not None)

    @property
    def scores_answer(self) -> bool:
        """Does an item's score include forced tokens after its codes (answer_suffix, answer_eos)?"""
        return bool(self.answer_suffix) or self.answer_eos

    def with_max_items(self, max_items: int | None) -> PromptTemplate:
        return self if max_items is None else replace(self, max_items=max_items)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "template") -> PromptTemplate:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: a prompt template is a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{source}: unknown prompt template field(s) {unknown} (known: {sorted(known)})")
        return cls(**raw)


LCREC_PREFIX = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\nThe user has interacted with items "
)
LCREC_SUFFIX = (
    " in chronological order. Can you predict the next possible item that the user may expect?\n\n### Response:"
)
# MiniOneRec (github AkaliKong/MiniOneRec) data.py EvalSidDataset and evaluate.py, as published
MINIONEREC_INSTRUCTION = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request. \n\n### Instruction:\nCan you predict the next possible item "
    "that the user may expect?\n\n"
)
MINIONEREC_PREFIX = (
    "### User Input: \nCan you predict the next possible item the user may expect, given the following chronological "
    "interaction history: "
)
PRESETS = {
    "codes": PromptTemplate(name="codes"),
    "lcrec": PromptTemplate(
        name="lcrec", prefix=LCREC_PREFIX, item="{index}. {codes}", separator=", ", suffix=LCREC_SUFFIX
    ),
    "minionerec": PromptTemplate(
        name="minionerec",
        instruction=MINIONEREC_INSTRUCTION,
        prefix=MINIONEREC_PREFIX,
        separator=", ",
        suffix="\n\n### Response:\n",
        max_items=50,  # their CSVs' histories are written whole (the data's own cap, 10 in the published releases)
        bos="auto",
        answer_suffix="\n",
        answer_eos=True,
    ),
}


# OpenOneRec (github Kuaishou-OneRec/OpenOneRec, Apache-2.0) data/onerec_data/sft/video_rec.py: their semantic ID
# format, system and user prompts as published ({query} -> {history}), written through their benchmark's
# qwen3_soft_switch.jinja2 with enable_thinking false, then their prompt_token
OPENONEREC_SYSTEM = (
    "你是一个智能推荐助手，能够根据用户的浏览历史预测用户可能感兴趣的下一个内容。",
    "你是一名内容推荐专家，擅长分析用户浏览行为并预测用户偏好。",
    "作为推荐系统助手，你需要根据用户历史浏览记录推荐合适的内容。",
    "你具备理解用户浏览模式并生成个性化推荐的能力。",
    "你是一个专业的内容推荐助手，能够根据用户过往浏览记录推荐相关内容。",
)
OPENONEREC_USER = (
    "根据以下用户浏览记录，请预测用户接下来可能观看的内容：\n{history}",
    "用户浏览了以下内容：\n{history}\n请预测用户的下一个观看意向。",
    "以下是用户的浏览历史：\n{history}\n请推荐用户可能感兴趣的下一个内容。",
    "用户历史浏览记录如下：\n{history}\n分析并预测用户接下来会观看什么内容。",
    "{history}\n根据上述浏览记录，推测用户的下一个观看目标。",
)
OPENONEREC_CHAT_TEMPLATE = "qwen3_soft_switch.jinja2"  # their benchmark's, beside the model


def openonerec(system: int = 0, user: int = 0) -> PromptTemplate:
    """OpenOneRec's video recommendation prompt with their `system`-th system prompt and `user`-th user prompt (from
    0): the history as `<|sid_begin|><s_a_X><s_b_Y><s_c_Z><|sid_end|>` back to back, its last 512 items (their
    HIST_MAX_LEN), their soft-switch chat template with thinking off, `<|sid_begin|>` after the generation prompt."""
    for what, i, texts in (("system", system, OPENONEREC_SYSTEM), ("user", user, OPENONEREC_USER)):
        if not 0 <= i < len(texts):
            raise ValueError(f"openonerec: their {what} prompts are numbered 0 .. {len(texts) - 1}, got {i}")
    return PromptTemplate(
        name="openonerec" if (system, user) == (0, 0) else f"openonerec:{system}:{user}",
        item="<|sid_begin|>{codes}<|sid_end|>",
        max_items=512,
        bos=False,
        code_token="<s_{level}_{code}>",
        messages=[
            {"role": "system", "content": OPENONEREC_SYSTEM[system]},
            {"role": "user", "content": OPENONEREC_USER[user]},
        ],
        chat_template=OPENONEREC_CHAT_TEMPLATE,
        chat_template_kwargs={"enable_thinking": False},
        generation_prefix="<|sid_begin|>",
    )


PRESETS["openonerec"] = openonerec()


def get_template(spec: str | PromptTemplate) -> PromptTemplate:
    """A preset name (`codes`, `lcrec`, `minionerec`, `openonerec`, `openonerec:S:U`), a path to a template JSON file,
    or a template."""
    if isinstance(spec, PromptTemplate):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    variant = re.fullmatch(r"openonerec:(\d+):(\d+)", spec)
    if variant:
        return openonerec(int(variant.group(1)), int(variant.group(2)))
    path = Path(spec)
    if path.is_dir():
        return read_template(path)
    if not path.is_file():
        raise ValueError(f"prompt template {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    return _read(path)


def _read(path: Path) -> PromptTemplate:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON prompt template ({e})") from None
    try:
        return PromptTemplate.from_dict(raw, str(path))
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None


def read_template(model_dir) -> PromptTemplate:
    """The prompt template a model directory carries; refused, saying how to add one, when it has none."""
    path = Path(model_dir) / TEMPLATE_FILE
    if not path.is_file():
        raise ValueError(
            f"{model_dir}: no {TEMPLATE_FILE}, so nothing says how this model's prompts are written. Add one with "
            f"`python -m jobs.template --model {model_dir} --preset lcrec` (the LC-Rec instruction prompt; `codes` "
            "for models trained on bare code tokens, or a JSON file of your own), or set models.template in the "
            "nightly config"
        )
    return _read(path)


def write_template(model_dir, template: PromptTemplate) -> Path:
    path = Path(model_dir) / TEMPLATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(template.to_dict(), indent=2) + "\n")
    return path
