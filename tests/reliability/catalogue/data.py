"""Catalogue cases of the section "Data" (their text: devtools/docgen/errors/data.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import Case
from tests.reliability.catalogue.setups import (
    HELLO,
    _bad_json,
    _chat,
    _chat_eot_eos_conflict,
    _chat_jinja_file_missing,
    _chat_messages_not_a_list,
    _chat_system_message_only,
    _chat_unknown_role,
    _chat_without_assistant,
    _csv_header_only,
    _dataset,
    _empty_file,
    _folder_without_data,
    _latin1_rows,
    _mixed_formats,
    _pretokenized,
    _row_empty_output,
    _row_missing_output,
    _row_wrong_type,
    _saved_dataset_without_split,
    _text_file,
    _tokenizer_without_eos,
    _tokenizer_without_template,
    _torch_bidirectional_mixed_rows,
    _torch_bidirectional_odd_rows,
)

CASES: tuple[Case, ...] = (
    Case(
        "torch-cp-bidirectional-row-length",
        setup=_torch_bidirectional_odd_rows,
    ),
    Case(
        "torch-cp-bidirectional-mixed-lengths",
        setup=_torch_bidirectional_mixed_rows,
    ),
    Case(
        "data-path-missing",
        setup=lambda ws: _dataset(ws, str(ws.data / "missing.jsonl")),
    ),
    Case(
        "data-folder-without-files",
        setup=_folder_without_data,
    ),
    Case(
        "data-file-empty",
        setup=_empty_file,
    ),
    Case(
        "data-not-json",
        setup=_bad_json,
    ),
    Case(
        "data-not-json-validate",
        setup=_bad_json,
        command="validate",
    ),
    Case(
        "data-first-rows-without-column",
        setup=lambda ws: _dataset(
            ws, ws.write_rows("columns.jsonl", [{"instruction": "Add 2 and 3.", "answer": "5"}] * 2)
        ),
        command="validate",
    ),
    Case(
        "data-not-utf8",
        setup=_latin1_rows,
    ),
    Case(
        "data-unsupported-file",
        setup=_text_file,
    ),
    Case(
        "data-column-missing",
        setup=lambda ws: _dataset(ws, str(ws.data / "train.jsonl"), field_output="answer"),
    ),
    Case(
        "data-row-field-missing",
        setup=_row_missing_output,
    ),
    Case(
        "data-row-wrong-type",
        setup=_row_wrong_type,
    ),
    Case(
        "data-row-empty-field",
        setup=_row_empty_output,
    ),
    Case(
        "chat-no-assistant-turn",
        setup=_chat_without_assistant,
    ),
    Case(
        "chat-messages-not-a-list",
        setup=_chat_messages_not_a_list,
    ),
    Case(
        "chat-system-message-only",
        setup=_chat_system_message_only,
    ),
    Case(
        "chat-unknown-role",
        setup=_chat_unknown_role,
    ),
    Case(
        "chat-no-template",
        setup=_tokenizer_without_template,
    ),
    Case(
        "data-all-too-long",
        keys={"sequence_len": 8},
    ),
    Case(
        "val-set-too-large",
        keys={"val_set_size": 1000},
    ),
    Case(
        "data-mixed-formats",
        setup=_mixed_formats,
    ),
    Case(
        "data-files-match-nothing",
        setup=lambda ws: _dataset(ws, str(ws.data), data_files="*.parquet"),
    ),
    Case(
        "data-files-with-a-file",
        setup=lambda ws: _dataset(ws, str(ws.data / "train.jsonl"), data_files="train.jsonl"),
    ),
    Case(
        "data-split-missing",
        setup=_saved_dataset_without_split,
    ),
    Case(
        "data-split-empty",
        setup=_csv_header_only,
    ),
    Case(
        "tokenizer-without-eos",
        setup=_tokenizer_without_eos,
    ),
    Case(
        "pretokenized-not-a-list",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": "5 6 7"}]),
    ),
    Case(
        "pretokenized-not-an-int",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": [5, 6.5, 7]}]),
    ),
    Case(
        "pretokenized-out-of-vocabulary",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": [5, 6, 99999]}]),
    ),
    Case(
        "pretokenized-labels-length",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": [5, 6, 7], "labels": [6, 7]}]),
    ),
    Case(
        "pretokenized-attention-mask-padding",
        setup=lambda ws: _pretokenized(
            ws, [{"input_ids": [5, 6, 7, 0], "labels": [5, 6, 7, -100], "attention_mask": [1, 1, 1, 0]}]
        ),
    ),
    Case(
        "data-without-type",
        setup=lambda ws: {
            "datasets": [
                {"path": ws.write_rows("alpaca.jsonl", [{"instruction": "a", "input": "", "output": "b"}])}
            ]
        },
    ),
    Case(
        "chat-message-not-an-object",
        setup=lambda ws: _chat(ws, [{"messages": ["Hi", "Hello!"]}]),
    ),
    Case(
        "chat-message-without-role",
        setup=lambda ws: _chat(ws, [{"messages": [{"content": "Hi"}, HELLO[1]]}]),
    ),
    Case(
        "chat-reasoning-not-text",
        setup=lambda ws: _chat(
            ws, [{"messages": [HELLO[0], {**HELLO[1], "reasoning_content": ["step"]}]}], chat_template="qwen3"
        ),
    ),
    Case(
        "chat-eot-token-not-one-token",
        setup=lambda ws: _chat(ws, [{"messages": HELLO}], eot_tokens=["assistant"]),
    ),
    Case(
        "chat-eot-eos-conflict",
        setup=_chat_eot_eos_conflict,
    ),
    Case(
        "chat-template-jinja-file-missing",
        setup=_chat_jinja_file_missing,
    ),
)
