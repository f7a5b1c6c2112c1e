"""The pages' code blocks are each run by tests/e2e/test_docs_examples.py or skipped with a
stated reason (tests/helper_docs.py), their commands are whole, and docs/configs.md lists every
shipped config. Reads the pages only: a new block without a marker fails here, in seconds."""

import re

import pytest
from helper_docs import COMMANDS, FENCE, MARKER, NOT_COMMANDS, PAGES, blocks
from helper_runs import ROOT

# A command that loads an app's config: it must name the config (`forge` refuses it otherwise).
APP_COMMAND = re.compile(r"forge (?:run|plan|submit|config show) (?:apps/|APP\b)")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_block_is_run_or_skipped_with_a_reason(page):
    wrong = []
    for block in blocks(page):
        if block.lang in COMMANDS:
            if not block.runs and block.skip_reason is None:
                wrong.append(
                    f"{block.name}: a ```{block.lang} block needs `<!-- doc-test: run -->` or "
                    "`<!-- doc-test: skip (the reason) -->` on the line above it"
                )
        elif block.lang in NOT_COMMANDS:
            if "doc-test" in block.marker:
                wrong.append(f"{block.name}: a ```{block.lang} block is never run: no marker")
        else:
            wrong.append(
                f"{block.name}: ```{block.lang}: a block is ```sh or ```python (commands and "
                "code, marked), or ```text or ```yaml (neither)"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_marker_is_well_formed_and_marks_a_block(page):
    lines = page.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if line.startswith("<!--") and "doc-test" in line:  # not the prose that shows one
            assert MARKER.fullmatch(line.strip()), f"{page.name}:{number}: {line}"
            below = lines[number] if number < len(lines) else ""
            assert below.startswith(FENCE), f"{page.name}:{number}: no block right below it"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_indented_code_block_escapes_the_markers(page):
    inside = False
    lines = page.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if line.startswith(FENCE):
            inside = not inside
        elif not inside and line.startswith("    ") and number > 1 and not lines[number - 2]:
            pytest.fail(f"{page.name}:{number}: an indented code block; fence it (```text, ...)")


def test_runnable_python_is_a_whole_script_or_an_app_its_page_runs():
    checked = 0
    for page in PAGES:
        for block in blocks(page):
            if block.lang != "python" or not block.runs:
                continue
            checked += 1
            assert "..." not in block.code, f"{block.name}: nothing left to fill in"
            if block.app_path is None:
                assert "print(" in block.code, f"{block.name}: a script prints what it shows"
                continue
            command = f"forge run {block.app_path} "
            runs = [b for b in blocks(page) if b.lang == "sh" and b.runs and command in b.code]
            assert runs, f"{block.name}: no run-marked block of its page runs {block.app_path}"
    assert checked


def test_every_forge_command_on_an_app_names_its_config():
    commands = []
    for page in PAGES:
        text = page.read_text()
        for block in blocks(page):
            if block.lang == "sh":
                commands += block.code.replace("\\\n", " ").splitlines()
        commands += re.findall(r"`([^`\n]+)`", text)  # inline code in the prose
    on_apps = [c for c in commands if APP_COMMAND.search(c)]
    assert on_apps
    assert [c for c in on_apps if "--config" not in c] == []


def test_the_configs_page_lists_every_shipped_config():
    page = (ROOT / "docs/configs.md").read_text()
    configs = ROOT / "configs"
    shipped = sorted(p.relative_to(configs).as_posix() for p in configs.rglob("*") if p.is_file())
    assert shipped
    assert [name for name in shipped if f"`{name}`" not in page] == []
