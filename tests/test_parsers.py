"""Property-based tests of the tracker and marker parsers: any input gives a value or a clear error."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.catalog.layout import LAYOUTS
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord, within_root
from shardpoint.errors import CorruptCheckpointError

layouts = st.sampled_from(sorted(LAYOUTS.values(), key=lambda layout: layout.name))


@given(layouts, st.one_of(st.none(), st.integers(min_value=0, max_value=10**9)))
def test_tracker_text_round_trips(layout, iteration):
    assert layout.parse_tracker(layout.tracker_text(iteration), "t") == iteration
    assert layout.parse_tracker(f"  {layout.tracker_text(iteration)}\n", "t") == iteration


@given(layouts, st.text(max_size=40))
def test_tracker_parser_never_fails_obscurely(layout, text):
    try:
        result = layout.parse_tracker(text, "tracker")
    except CorruptCheckpointError as exc:
        assert "tracker" in str(exc) and "iteration" in str(exc)
    else:
        assert result is None or (isinstance(result, int) and result >= 0)


@given(layouts, st.integers(min_value=0, max_value=10**9))
def test_dir_names_round_trip(layout, iteration):
    assert layout.parse_dir_name(layout.dir_name(iteration)) == iteration


names = st.text(alphabet="abcdefghij_/.0123456789", min_size=1, max_size=20)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)
)


@st.composite
def metadata(draw):
    files = draw(
        st.dictionaries(
            names.filter(within_root),
            st.builds(FileRecord, st.integers(0, 2**40), st.text("0123456789abcdef", min_size=16, max_size=16)),
            max_size=4,
        )
    )
    return CheckpointMetadata(
        iteration=draw(st.integers(0, 10**9)),
        format=draw(st.sampled_from(["dist", "torch"])),
        topology={k: draw(st.integers(1, 64)) for k in ("tp", "pp", "dp")},
        release=draw(st.booleans()),
        config=draw(st.dictionaries(st.text(max_size=8), json_scalars, max_size=4)),
        files=files,
        consumed_samples=draw(st.one_of(st.none(), st.integers(0, 10**12))),
        metrics=draw(
            st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False), max_size=3)
        ),
    )


@given(metadata())
def test_marker_round_trips(meta):
    assert CheckpointMetadata.from_json(meta.to_json(), "m") == meta


# names built to point outside (absolute, up past a sibling, up from inside), and random ones;
# filtering random names alone keeps too few of them (hypothesis' filter_too_much health check)
outside_names = st.one_of(
    names.map(lambda n: "/" + n),
    st.tuples(names, names).map(lambda p: f"../../{p[0]}/{p[1]}"),
    names.map(lambda n: f"{n}/../../../x"),
    names,
).filter(lambda n: not within_root(n))


@given(outside_names)
def test_a_marker_naming_a_file_outside_its_directory_is_refused(name):
    meta = CheckpointMetadata(
        iteration=1, format="dist", topology={"tp": 1, "pp": 1, "dp": 1}, release=False, files={}
    ).to_json()
    data = json.loads(meta)
    data["files"] = {name: {"size": 1, "xxh3_64": "0" * 16}}
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint directory"):
        CheckpointMetadata.from_json(json.dumps(data), "m")


@settings(max_examples=300)
@given(metadata(), st.data())
def test_damaged_marker_is_a_clear_error_or_valid(meta, data):
    raw = json.loads(meta.to_json())
    key = data.draw(st.sampled_from(sorted(raw)))
    raw[key] = data.draw(st.one_of(json_scalars, st.lists(json_scalars, max_size=2), st.just({})))
    try:
        parsed = CheckpointMetadata.from_json(json.dumps(raw), "shardpoint.json")
    except CorruptCheckpointError as exc:
        assert "shardpoint.json" in str(exc)
    else:
        assert isinstance(parsed.iteration, int) and parsed.format in ("dist", "torch")


@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_crash_the_marker_parser(blob):
    try:
        CheckpointMetadata.from_json(blob, "shardpoint.json")
    except CorruptCheckpointError:
        pass
