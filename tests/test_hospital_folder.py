"""A hospital engineer's image folder (issue 62, points 5-8 and 10): 16-bit grey scans in class
folders, a users.csv naming each scan's patient, through ``dpscale train`` as they would run it.
Each test reproduces what was silent or refused in one generic line, then checks what is said."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from dpscale.cli import main
from dpscale.data.folder import list_image_folder
from dpscale.data.users_csv import read_users_manifest
from dpscale.data.formats import DatasetError

# patient p holds SCANS[p] scans (enough people that the hashed hold-out keeps some on each side);
# the first half are "finding", the rest "normal"
SCANS = [1, 2, 3, 5, 1, 2, 1, 2, 6, 1, 2, 1] * 4


def scans(tmp_path, *, csv_text: str | None = None) -> tuple:
    """A folder of 8x8 16-bit grey PNG scans and its users.csv rows (``path,user``)."""
    g = np.random.default_rng(0)
    root = tmp_path / "scans"
    rows = []
    for p, n in enumerate(SCANS):
        label = "finding" if p < len(SCANS) // 2 else "normal"
        (root / label).mkdir(parents=True, exist_ok=True)
        for s in range(n):
            name = f"{label}/p{p:02d}-{s}.png"
            Image.fromarray(g.integers(0, 65536, (8, 8), dtype=np.uint16)).save(root / name)
            rows.append((name, f"patient-{p:02d}"))
    text = "path,user\n" + "".join(f"{a},{b}\n" for a, b in rows) if csv_text is None else csv_text
    (root / "users.csv").write_text(text, encoding="utf-8")
    return root, rows


def train(tmp_path, root, capsys, *settings: str) -> tuple[int, str]:
    """``dpscale train`` of a linear model on ``root`` (2 steps); its exit code and stderr."""
    base = [
        f"run.out_dir={tmp_path / 'run'}",
        "run.seed=0",
        "model.name=linear",
        "data.name=imagefolder",
        f"data.root={root}",
        "dp.batch_size=2",
        "dp.noise_multiplier=1",
        "dp.epsilon=null",
        "train.steps=2",
    ]
    code = main(["train", "--quiet", *(a for s in [*base, *settings] for a in ("--set", s))])
    return code, capsys.readouterr().err


def lines_with(err: str, words: str) -> list[str]:
    return [line for line in err.splitlines() if words in line]


# point 5: users.csv read, the run example-level, and not a word about it
def test_an_example_level_run_on_a_folder_with_users_says_what_it_means_for_a_person(
    tmp_path, capsys
):
    root, _ = scans(tmp_path)
    code, err = train(tmp_path, root, capsys)
    assert code == 0
    said = lines_with(err, "data.privacy_unit=user")
    assert len(said) == 1, err
    line = said[0]
    listing = list_image_folder(root)
    people, most = (
        len(set(listing.train_users.tolist())),
        max(np.unique(listing.train_users, return_counts=True)[1]),
    )
    assert (
        f"{people} people" in line
        and f"up to {most} images" in line
        and f"--group-size {most}" in line
    )
    assert "group privacy" in line and "--set data.privacy_unit=user" in line
    counts = np.unique(listing.train_users, return_counts=True)[1]
    # a concrete starting k (the line said K), covering 9 in 10 people
    k = int(np.ceil(np.quantile(counts, 0.9)))
    assert f"dp.max_examples_per_user={k} (9 in 10 people have at most {k} images" in line
    assert (counts <= k).mean() >= 0.9 and line.startswith(
        f"the training set names {people} people"
    )


def test_the_person_reading_is_the_group_bound_dpscale_account_gives(tmp_path, capsys):
    """The header's figure for the person with the most images is the account command's, not a second formula."""
    root, _ = scans(tmp_path)
    code, err = train(
        tmp_path, root, capsys, "dp.epsilon=8", "dp.noise_multiplier=null", "dp.delta=1e-3"
    )
    assert code == 0
    line = lines_with(err, "data.privacy_unit=user")[0]
    command = line.split("`")[1].split()
    assert command[:2] == ["dpscale", "account"]
    assert main(command[1:] + ["--json"]) == 0
    group = json.loads(capsys.readouterr().out)["group_privacy"]
    expected = f"epsilon {group['epsilon']:.3g}" if group["epsilon"] is not None else "nothing"
    assert expected in line, (expected, line)


def test_a_user_level_run_says_how_many_images_train_who_exceeds_k_and_the_split_in_people(
    tmp_path, capsys
):
    root, _ = scans(tmp_path)
    code, err = train(
        tmp_path, root, capsys, "data.privacy_unit=user", "dp.max_examples_per_user=2"
    )
    assert code == 0
    # point 5's line is for the example unit
    assert not lines_with(err, "--set data.privacy_unit=user")
    listing = list_image_folder(root)
    _, counts = np.unique(listing.train_users, return_counts=True)
    said = lines_with(err, "people have more than k = 2")
    assert len(said) == 1, err
    assert f"{len(listing.train_files)} training images of {len(counts)} people" in said[0]
    assert f"{int((counts > 2).sum())} of {len(counts)} people have more than k = 2" in said[0]
    split = lines_with(err, "users.csv:")
    assert len(split) == 1 and f"test: {len(listing.test_files)} images of " in split[0], err


# point 6: what the listing leaves out is named; a csv row naming nothing readable is refused
def test_files_that_are_not_images_are_counted_and_named(tmp_path, capsys):
    root, _ = scans(tmp_path)
    for name in ("finding/notes.txt", "normal/Thumbs.db", "normal/scan.dcm"):
        (root / name).write_bytes(b"x")
    listing = list_image_folder(root)
    assert sorted(listing.left_out) == ["finding/notes.txt", "normal/Thumbs.db", "normal/scan.dcm"]
    code, err = train(tmp_path, root, capsys)
    assert code == 0
    said = lines_with(err, "not images dpscale reads")
    assert len(said) == 1 and "left out 3 file(s)" in said[0] and "normal/scan.dcm" in said[0]


@pytest.mark.parametrize(
    "name, words",
    [
        ("normal/scan.dcm", "normal/scan.dcm is not an image dpscale reads"),
        ("normal/gone.png", "normal/gone.png does not exist"),
    ],
)
def test_a_users_csv_row_naming_nothing_readable_is_refused_with_its_line(
    tmp_path, capsys, name, words
):
    root, rows = scans(tmp_path)
    if name.endswith(".dcm"):
        (root / name).write_bytes(b"DICM")
    text = "path,user\n" + "".join(f"{a},{b}\n" for a, b in rows[:3]) + f"{name},patient-99\n"
    text += "".join(f"{a},{b}\n" for a, b in rows[3:])
    (root / "users.csv").write_text(text)
    with pytest.raises(DatasetError, match=f"users.csv line 5: {words}"):
        list_image_folder(root)
    code, err = train(tmp_path, root, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "line 5" in err


# point 7: users.csv as Excel writes it
@pytest.mark.parametrize(
    "header, sep, bom",
    [
        ("path,user", ",", True),
        ("path, user", ", ", False),
        ("path;user", ";", True),
        ("Path,User", ",", False),
        ("path,patient_id", ",", False),
        ("Path ; Patient ID", " ; ", True),
    ],
)
def test_an_excel_users_csv_is_read(tmp_path, header, sep, bom):
    root, rows = scans(tmp_path)
    text = header + "\r\n" + "".join(f"{a}{sep}{b}\r\n" for a, b in rows)
    (root / "users.csv").write_bytes(("\ufeff" if bom else "").encode() + text.encode())
    listing = list_image_folder(root)
    assert listing.train_users is not None
    users = dict(rows)
    assert [
        users[str(f.relative_to(root))] for f in listing.train_files
    ] == listing.train_users.tolist()


@pytest.mark.parametrize(
    "header, words",
    [
        ("file,who", "found columns 'file', 'who'"),
        ("path,user,patient_id", "both 'user' and 'patient_id'"),
    ],
)
def test_an_unknown_or_ambiguous_header_names_the_columns_found_and_expected(
    tmp_path, header, words
):
    root, rows = scans(tmp_path)
    (root / "users.csv").write_text(header + "\n" + "".join(f"{a},{b},{b}\n" for a, b in rows))
    with pytest.raises(DatasetError, match=words) as refused:
        list_image_folder(root)
    assert "expected" in str(refused.value) and "\n" not in str(refused.value)


def test_values_are_stripped_so_a_padded_id_is_the_same_person(tmp_path):
    root, rows = scans(tmp_path)
    (root / "users.csv").write_text("path,user\n" + "".join(f" {a} , {b} \n" for a, b in rows))
    users = read_users_manifest(root, *_listed(root))
    assert set(users.tolist()) == {b for _, b in rows}


def _listed(root):
    listing = list_image_folder(root)
    files = listing.train_files + listing.test_files
    labels = np.concatenate([listing.train_labels, listing.test_labels])
    return files, labels, list(listing.classes)


# point 8: a colour file among grey scans makes every image 3-channel
def test_a_colour_file_among_grey_scans_is_named(tmp_path, capsys):
    root, _ = scans(tmp_path)
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(root / "normal" / "photo.png")
    with (root / "users.csv").open("a") as handle:
        handle.write(f"normal/photo.png,patient-{len(SCANS) - 1}\n")
    listing = list_image_folder(root)
    assert listing.mode == "RGB" and listing.colour_files == ("normal/photo.png",)
    code, err = train(tmp_path, root, capsys)
    assert code == 0
    said = lines_with(err, "colour")
    assert (
        len(said) == 1
        and f"1 of {sum(SCANS) + 1} images" in said[0]
        and "normal/photo.png" in said[0]
        and "3 channels" in said[0]
    )


def test_an_all_grey_or_all_colour_folder_says_nothing_about_colour(tmp_path, capsys):
    root, _ = scans(tmp_path)
    assert list_image_folder(root).colour_files == ()
    code, err = train(tmp_path, root, capsys)
    assert code == 0 and not lines_with(err, "colour")


def test_the_hospital_scenario_runs_from_the_docs_as_written(tmp_path, capsys, monkeypatch):
    """docs/privacy-units.md's hospital commands, word for word, on a tiny collection: the
    generator's command line, then the train command with its length, B and output shortened."""
    import runpy
    import shlex
    import sys
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "privacy-units.md").read_text()
    section = docs.split("## A hospital's scans")[1].split("\n## ")[0]
    block = section.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")
    generate, train_line = (line for line in block.splitlines() if line.strip())
    monkeypatch.chdir(tmp_path)
    script = shlex.split(generate)
    assert script[:2] == ["python", "scripts/hospital_scans.py"]
    args = [a if a != "1500" else "60" for a in script[2:]]
    monkeypatch.setattr(sys, "argv", ["hospital_scans.py", *args])
    runpy.run_path(str(Path(__file__).resolve().parent.parent / script[1]), run_name="__main__")
    command = shlex.split(train_line)
    assert command[:2] == ["dpscale", "train"]
    short = [
        "--set",
        "train.steps=2",
        "--set",
        "dp.batch_size=8",
        "--set",
        "train.ema_decay=null",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
    ]
    assert main([*command[1:], "--quiet", *short]) == 0
    err = capsys.readouterr().err
    assert lines_with(err, "privacy unit user:") and lines_with(err, "users.csv: 60 people")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["privacy_unit"] == "user" and summary["max_examples_per_user"] == 4


# issue 62's second review (a hospital engineer on a fresh clone): spreadsheet exports' other habits
def test_windows_backslashes_in_users_csv_name_the_image(tmp_path):
    root, rows = scans(tmp_path)
    (root / "users.csv").write_text(
        "path,user\n" + "".join(f"{a.replace('/', chr(92))},{b}\n" for a, b in rows)
    )
    assert set(read_users_manifest(root, *_listed(root)).tolist()) == {b for _, b in rows}


def test_a_path_that_differs_only_in_case_is_refused_naming_the_listed_one(tmp_path):
    root, rows = scans(tmp_path)
    rows[0] = (rows[0][0].upper(), rows[0][1])
    (root / "users.csv").write_text("path,user\n" + "".join(f"{a},{b}\n" for a, b in rows))
    with pytest.raises(
        DatasetError,
        match=r"line 2: FINDING/P00-0.PNG does not exist .*did you mean finding/p00-0.png",
    ):
        list_image_folder(root)


def test_an_image_named_twice_is_refused_naming_both_lines_and_both_users(tmp_path):
    root, rows = scans(tmp_path)
    (root / "users.csv").write_text(
        "path,user\n" + "".join(f"{a},{b}\n" for a, b in [*rows, (rows[0][0], "patient-77")])
    )
    with pytest.raises(DatasetError) as error:
        list_image_folder(root)
    message = str(error.value)
    assert (
        f"line {len(rows) + 2}: {rows[0][0]} is named twice (line 2 names the same image" in message
    )
    assert "'patient-00'" in message and "'patient-77'" in message


def test_ids_that_differ_only_in_case_or_leading_zeros_are_said(tmp_path, capsys):
    """'PATIENT-02' beside 'patient-02' and '7' beside '007' were separate people without a word."""
    root, rows = scans(tmp_path)
    # one of patient-02's three scans
    rows = [(a, b.upper() if i == 5 else b) for i, (a, b) in enumerate(rows)]
    (root / "users.csv").write_text("path,user\n" + "".join(f"{a},{b}\n" for a, b in rows))
    notes = [n for n in list_image_folder(root).notes if "differ from another only in case" in n]
    assert (
        len(notes) == 1 and "'patient-02' and 'PATIENT-02'" in notes[0] and "1 id(s)" in notes[0]
    ), notes
    _, err = train(tmp_path, root, capsys)
    assert notes[0] in err
    from dpscale.data.users_csv import look_alike_ids

    assert look_alike_ids(["7", "007", "p-07", "P-7", "p-70", "8"]) == (
        ("7", "007"),
        ("p-07", "P-7"),
    )


def test_an_official_split_says_its_people_and_those_who_also_train(tmp_path, capsys):
    """Patients with scans in both train/ and test/ (test accuracy measured on people the model saw)
    passed without a word."""
    root, rows = scans(tmp_path)
    official = tmp_path / "official"
    for split in ("train", "test"):
        for name, _ in rows:
            (official / split / name).parent.mkdir(parents=True, exist_ok=True)
            (official / split / name).write_bytes((root / name).read_bytes())
    named = [(f"{split}/{a}", b) for split in ("train", "test") for a, b in rows]
    (official / "users.csv").write_text("path,user\n" + "".join(f"{a},{b}\n" for a, b in named))
    people = len({b for _, b in rows})
    note = next(n for n in list_image_folder(official).notes if "official test split" in n)
    assert (
        f"{len(rows)} images: {len(rows)} named, of {people} people, {people} of whom also train"
        in note
    )
    (official / "users.csv").write_text(
        "path,user\n" + "".join(f"{a},{b}\n" for a, b in named[: len(rows) + 3])
    )
    note = next(n for n in list_image_folder(official).notes if "official test split" in n)
    assert "3 named" in note and f"it names nobody for the other {len(rows) - 3}" in note


def test_excels_unicode_text_users_csv_is_read(tmp_path):
    """Excel's "Unicode text" export (UTF-16 with a byte-order mark, tab-separated) was refused."""
    root, rows = scans(tmp_path)
    (root / "users.csv").write_text(
        "Path\tPatient ID\n" + "".join(f"{a}\t{b}\n" for a, b in rows), encoding="utf-16"
    )
    assert set(read_users_manifest(root, *_listed(root)).tolist()) == {b for _, b in rows}


def test_an_image_damaged_past_its_header_names_the_setting_that_leaves_it_out(tmp_path, capsys):
    root, _ = scans(tmp_path)
    victim = root / "normal" / "p30-0.png"
    # the header intact: the listing's check passes it
    victim.write_bytes(victim.read_bytes()[:-40])
    code, err = train(tmp_path, root, capsys)
    assert code == 2 and err.splitlines()[-1].endswith("leaves unreadable ones out)"), err[-400:]
    assert "data.skip_corrupt=true" in err.splitlines()[-1]
    code, err = train(tmp_path / "skip", root, capsys, "data.skip_corrupt=true")
    assert code == 0


# issue 62's second adversarial review
def _with_rows(root, rows) -> None:
    (root / "users.csv").write_text(
        "path,user\n" + "".join(f"{a},{b}\n" for a, b in rows), encoding="utf-8"
    )


def test_a_user_with_a_nul_is_refused_not_merged_with_the_one_without(tmp_path):
    """'patient-00\\x00' became 'patient-00' in numpy's array: two people made one, without a word."""
    root, rows = scans(tmp_path)
    # patient-01's first scan, now a NUL-padded 'patient-00'
    rows[1] = (rows[1][0], "patient-00\x00")
    _with_rows(root, rows)
    with pytest.raises(
        DatasetError, match=r"line 3: the user 'patient-00\\x00' holds a control character"
    ):
        list_image_folder(root)


def test_ids_that_differ_only_in_unicode_form_are_said():
    from dpscale.data.users_csv import look_alike_ids

    composed, decomposed = "jos\u00e9", "jose\u0301"
    assert look_alike_ids([composed, decomposed, "ana"]) == ((composed, decomposed),)


@pytest.mark.parametrize("bad", ["nul", "loop", "huge"])
def test_paths_that_name_no_file_and_oversized_fields_are_refused_in_one_line(
    tmp_path, capsys, bad
):
    """A NUL in a path, a link loop and a field past the csv module's limit ended in tracebacks."""
    root, rows = scans(tmp_path)
    if bad == "loop":
        (root / "normal" / "loop.png").symlink_to(root / "normal" / "loop.png")
    name = {"nul": "normal/a\x00b.png", "loop": "normal/loop.png", "huge": "x" * 200_000}[bad]
    _with_rows(root, [*rows, (name, "patient-99")])
    code, err = train(tmp_path, root, capsys)
    assert (
        code == 2 and "Traceback" not in err and f"line {len(rows) + 2}" in err.splitlines()[-1]
    ), err[-300:]


def test_a_link_to_a_listed_image_is_refused(tmp_path):
    """A row naming b/x.png gave its user to a link a/y.png -> b/x.png too: one image trained twice."""
    root, rows = scans(tmp_path)
    (root / "finding" / "link.png").symlink_to(root / "normal" / rows[-1][0].split("/")[1])
    _with_rows(root, rows)
    with pytest.raises(DatasetError, match="are one file"):
        list_image_folder(root)
