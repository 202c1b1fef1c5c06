"""subquad.files: every reader's refusals, each naming the file, what is wrong and the fix."""

from __future__ import annotations

import json

import pytest
import torch

from subquad.files import (
    FileError,
    check_fields,
    check_gguf,
    json_checksum,
    load_safetensors,
    read_json,
    read_jsonl,
    read_text,
    read_toml,
    write_atomic,
)


def _file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def test_a_file_error_names_the_file_the_problem_and_the_fix(tmp_path):
    error = FileError(tmp_path / "x.json", "is broken", "write it again")
    assert str(error) == f"{tmp_path / 'x.json'}: is broken; write it again"
    assert isinstance(error, ValueError) and error.path == tmp_path / "x.json" and error.fix == "write it again"
    assert str(FileError("y", "is broken")) == "y: is broken"


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", r"empty.txt: is empty; a text file needs content; FIX"),
        (b" \n\t\n", r"empty.txt: is empty"),
        (b"abc\0def", r"empty.txt: is binary \(it holds NUL bytes\), not a text file; FIX"),
        (b"line one\nline \xff two", r"empty.txt: is not UTF-8 text \(byte 14, line 2\): not a text file; FIX"),
    ],
)
def test_text_that_is_empty_binary_or_not_utf8_is_refused(tmp_path, data, match):
    path = _file(tmp_path, "empty.txt", data)
    with pytest.raises(FileError, match=match):
        read_text(path, fix="FIX")


def test_text_reads_with_replacement_where_asked_and_a_missing_or_unreadable_file_is_named(tmp_path):
    assert read_text(_file(tmp_path, "a.txt", b"caf\xe9"), errors="replace") == "caf\ufffd"
    with pytest.raises(FileNotFoundError, match=r"no run config at .*none.json"):
        read_json(tmp_path / "none.json", "run config")
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(FileError, match=r"folder.json: cannot be read as a run config \(Is a directory\)"):
        read_json(tmp_path / "folder.json", "run config")


def test_json_errors_give_the_line_and_column_and_the_kind_expected(tmp_path):
    with pytest.raises(
        FileError, match=r"c.json: is not valid JSON \(Expecting ',' delimiter at line 2, column 9\); F"
    ):
        read_json(_file(tmp_path, "c.json", '{"a": 1,\n "b": 2 "c": 3}'), fix="F")
    with pytest.raises(FileError, match=r"c.json: holds an array where a run config holds an object"):
        read_json(_file(tmp_path, "c.json", "[1, 2]"), "run config")
    assert read_json(_file(tmp_path, "c.json", "[1, 2]"), kind=list) == [1, 2]


def test_json_lines_name_the_broken_line_and_a_cut_off_last_line_may_be_dropped(tmp_path):
    good = '{"step": 1}\n\n{"step": 2}\n'
    assert read_jsonl(_file(tmp_path, "m.jsonl", good)) == [(1, {"step": 1}), (3, {"step": 2})]
    cut = _file(tmp_path, "m.jsonl", good + '{"step": 3, "lo')
    assert [n for n, _ in read_jsonl(cut, partial_last=True)] == [1, 3]
    with pytest.raises(FileError, match=r"m.jsonl: line 4 is not valid JSON \(Unterminated string"):
        read_jsonl(cut)
    broken = _file(tmp_path, "m.jsonl", '{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(FileError, match=r"m.jsonl: line 2 is not valid JSON"):
        read_jsonl(broken, partial_last=True)  # not the last line: refused
    with pytest.raises(FileError, match=r"m.jsonl: line 2 is an array, not an object; F"):
        read_jsonl(_file(tmp_path, "m.jsonl", '{"step": 1}\n[2]\n'), fix="F")
    with pytest.raises(FileError, match=r"m.jsonl: line 1 is not valid JSON \(not UTF-8\)"):
        read_jsonl(_file(tmp_path, "m.jsonl", b'{"a": "\xff"}\n'))
    with pytest.raises(FileError, match=r"m.jsonl: is binary"):
        read_jsonl(_file(tmp_path, "m.jsonl", b"\0\0\0"))


def test_toml_errors_name_the_file_and_the_line(tmp_path):
    assert read_toml(_file(tmp_path, "c.toml", 'dim = 16\nname = "x"\n')) == {"dim": 16, "name": "x"}
    with pytest.raises(FileError, match=r"c.toml: is not valid TOML \(.*line 2.*\); F"):
        read_toml(_file(tmp_path, "c.toml", 'dim = 16\nname = "x\n'), fix="F")


@pytest.mark.parametrize(
    "values, match",
    [
        ({"b": 1}, r"f.json: layer 3 lacks 'a'; F"),
        ({"a": 1, "z": 2}, r"f.json: layer 3 has unknown field\(s\) \['z'\]; known: a, b; F"),
        ({"a": "1"}, r"f.json: layer 3 field 'a' is a string \('1'\), not an integer; F"),
        ({"a": True}, r"f.json: layer 3 field 'a' is a boolean \(True\), not an integer"),
        ({"a": 1, "b": [1]}, r"field 'b' is an array \(\[1\]\), not a number or null"),
    ],
)
def test_fields_are_checked_for_presence_names_and_types(tmp_path, values, match):
    with pytest.raises(FileError, match=match):
        check_fields(values, tmp_path / "f.json", {"a": int, "b": (float, type(None))}, ("a",), "layer 3", "F")


def test_fields_of_the_right_types_pass_and_an_integer_is_a_number(tmp_path):
    check_fields({"a": 1, "b": 2}, tmp_path / "f.json", {"a": int, "b": float}, ("a",))
    check_fields({"a": 1, "b": None}, tmp_path / "f.json", {"a": int, "b": (float, type(None))})


def test_safetensors_that_are_truncated_or_not_safetensors_are_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0).view(2, 3)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    assert torch.equal(load_safetensors(tmp_path / "t.safetensors")["w"], torch.arange(6.0).view(2, 3))
    for damaged in (data[:5], data[:-4], b"not safetensors at all"):
        (tmp_path / "t.safetensors").write_bytes(damaged)
        with pytest.raises(FileError, match=r"t.safetensors: is not a readable safetensors file \(.*\); it may be "
                           "truncated or damaged; copy it again"):  # fmt: skip
            load_safetensors(tmp_path / "t.safetensors")


@pytest.mark.parametrize(
    "data, match",
    [
        (
            b"PK\x03\x04rest",
            r"m.gguf: is not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\); pass a .gguf",
        ),
        (b"", r"m.gguf: is not a GGUF file \(it starts with b''"),
        (b"GGUF\x63\x00\x00\x00", r"m.gguf: is a GGUF file of unknown version 99; pass a GGUF file of version 1 to 3"),
        (b"GGUF\x03", r"m.gguf: is a GGUF file of unknown version None"),
    ],
)
def test_a_file_that_is_not_gguf_is_refused(tmp_path, data, match):
    with pytest.raises(FileError, match=match):
        check_gguf(_file(tmp_path, "m.gguf", data))


def test_a_gguf_header_passes(tmp_path):
    check_gguf(_file(tmp_path, "m.gguf", b"GGUF\x03\x00\x00\x00" + bytes(16)))


def test_the_json_checksum_ignores_layout_but_not_content(tmp_path):
    record = {"b": [1, 2.5, None], "a": {"x": "y"}}
    again = json.loads(json.dumps(record, indent=4))
    assert json_checksum(again) == json_checksum(record)
    assert json_checksum({**record, "a": {"x": "z"}}) != json_checksum(record)


def test_an_atomic_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
