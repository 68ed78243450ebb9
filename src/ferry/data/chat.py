"""Chat data (`data.format=chat`): JSONL records of conversations, rendered with the tokenizer's own
chat template and tokenized with each token's loss weight (1 for the assistant's replies, 0 for
everything else: system and user turns, the template's markup around them, the end-of-document id).

A record holds `messages` (a list of `{role, content}`) or `prompt` and `completion` (a user turn
and its reply). The template is the `chat_template` of the tokenizer directory's
`tokenizer_config.json` (or its `chat_template.jinja`), rendered with jinja2 in a sandbox the way
`transformers`' `apply_chat_template` renders it (trim_blocks, lstrip_blocks, `raise_exception`,
`tojson`, the special tokens as variables), so neither transformers nor torch is needed.

Which characters are replies is found by rendering prefixes: reply i is what the conversation
through message i adds to the conversation before it with the generation prompt. The whole
conversation is tokenized once, and a token counts when its characters overlap a reply's
(`tokenizers`' offsets). A template that renders earlier turns differently once later ones follow
is refused: its replies cannot be told apart that way.
"""

import dataclasses
import datetime
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Integer

from ferry.errors import DataError

ROLES_COUNTED = ("assistant",)


class ChatDataError(DataError):
    """A chat record, or a tokenizer without a chat template, that cannot give training examples."""


def conversation(record: object, where: str) -> list[dict[str, Any]]:
    """The messages of one JSONL record: its `messages`, or its `prompt` and `completion` as a
    user turn and the assistant's reply; refused naming `where` (path:line) and the fix."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where} is not a JSON object; a chat record holds messages, or prompt and completion")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatDataError(f"{where}: messages is not a non-empty list of {{role, content}} objects")
        for number, message in enumerate(messages):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ChatDataError(
                    f"{where}: message {number} is not an object with a string role and a string content"
                )
        if not any(message["role"] in ROLES_COUNTED for message in messages):
            raise ChatDataError(f"{where} has no assistant message: nothing of it would count in the loss")
        return messages
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    raise ChatDataError(
        f"{where} holds neither messages (a list of {{role, content}}) nor string prompt and completion fields "
        f"(its keys: {', '.join(sorted(record)) or 'none'}); data.format=chat reads those"
    )


def parse_record(line: bytes, where: str) -> list[dict[str, Any]]:
    """The conversation of one JSONL line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ChatDataError(f"{where} is not JSON ({error})") from error
    except UnicodeDecodeError as error:
        raise ChatDataError(f"{where} is not JSON: not UTF-8 text ({error.reason} at byte {error.start})") from error
    return conversation(record, where)


def tokenizer_directory(spec: str) -> Path:
    """The directory of a `data.tokenizer` path (a tokenizer.json, or the directory holding one)."""
    path = Path(spec).expanduser()
    return path if path.is_dir() else path.parent


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer directory's chat template and the special tokens it may name."""

    source: str  # the template's jinja text
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as tokenizer_config.json names them

    @property
    def identity(self) -> str:
        """What decides the rendered text: part of a chat corpus's cache key."""
        text = json.dumps({"template": self.source, "special": self.special_tokens}, sort_keys=True)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        compiled = _compiled(self.source)
        return compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )  # fmt: skip

    def reply_spans(self, messages: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text, and the [start, end) characters of each assistant reply."""
        import jinja2

        try:
            text = self.render(messages, add_generation_prompt=False)
            spans = []
            for index, message in enumerate(messages):
                if message["role"] not in ROLES_COUNTED:
                    continue
                before = self.render(messages[:index], add_generation_prompt=True)
                through = self.render(messages[: index + 1], add_generation_prompt=False)
                if not (through.startswith(before) and text.startswith(through)):
                    raise ChatDataError(
                        f"{where}: the chat template renders a conversation's earlier turns differently once later "
                        "ones follow (or its generation prompt is not where the reply starts), so ferry cannot tell "
                        "the assistant's replies apart; use a template whose turns render the same in every prefix"
                    )
                spans.append((len(before), len(through)))
        except jinja2.TemplateError as error:
            raise ChatDataError(f"{where}: the chat template refused the conversation: {error}") from error
        return text, spans


def _special_token(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def chat_template_of(spec: str) -> ChatTemplate:
    """The chat template of tokenizer `spec`'s directory: tokenizer_config.json's `chat_template`
    (a string, or the `default` of a list of named ones), else chat_template.jinja; refused in one
    line when it has none."""
    directory = tokenizer_directory(spec)
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ChatDataError(
                f"{config_path} is not JSON ({error}); fix it or point data.tokenizer elsewhere"
            ) from error
        config = loaded if isinstance(loaded, dict) else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if not isinstance(template, str) or not template.strip():
        raise ChatDataError(
            f"data.format=chat needs a chat template, and the tokenizer data.tokenizer={spec} has none (no "
            f"chat_template in {config_path}, no {directory / 'chat_template.jinja'}); use the tokenizer directory of "
            "a chat model, or add its template there"
        )
    special = {
        key: token
        for key, value in config.items()
        if key.endswith("_token") and (token := _special_token(value)) is not None
    }
    return ChatTemplate(template, special)


@functools.cache
def _compiled(source: str) -> Any:
    """The template compiled as transformers compiles it: a sandbox, trim_blocks and lstrip_blocks,
    loop controls, `{% generation %}` (rendered as its body), `raise_exception`, `tojson` and
    `strftime_now`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask marker; ferry finds
        the replies by rendering prefixes, so the body is rendered as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatDataError(
            f"the tokenizer's chat template is not valid jinja: {error} (line {error.lineno})"
        ) from error


def counted_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a reply's span, else 0 (uint8)."""
    weights = np.zeros(len(offsets), np.uint8)
    if not len(offsets):
        return weights
    starts, ends = np.asarray(offsets, np.int64).T
    for start, end in spans:
        weights |= ((starts < end) & (ends > start)).astype(np.uint8)
    return weights


@dataclasses.dataclass(frozen=True)
class ChatEncoder:
    """Conversations to token ids and loss weights with a Hugging Face tokenizer and its template;
    each example ends with the end-of-document id (weight 0)."""

    tokenizer: Any  # tokenizers.Tokenizer
    end_of_document: int
    template: ChatTemplate

    def encode_records(
        self, records: Sequence[bytes], keys: Sequence[str]
    ) -> list[tuple[Integer[np.ndarray, " tokens"], Integer[np.ndarray, " tokens"]]]:
        """(ids, weights) of each JSONL record; `keys` name them in a refusal."""
        rendered = [
            self.template.reply_spans(parse_record(record, key), key) for record, key in zip(records, keys, strict=True)
        ]
        encodings = self.tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        examples = []
        for (_, spans), encoding in zip(rendered, encodings, strict=True):
            ids = np.append(np.asarray(encoding.ids, np.uint32), np.uint32(self.end_of_document))
            weights = np.append(counted_tokens(encoding.offsets, spans), np.uint8(0))
            examples.append((ids, weights))
        return examples
