"""The checked-in diagrams and reference are exactly what the table generates."""

from pathlib import Path

from lifecycle import diagram
from lifecycle.table import ASLEEP, TABLE, State, row_edges

ROOT = Path(__file__).resolve().parents[2]


class TestGenerated:
    def test_checked_in_files_match_the_table(self):
        """Run `make diagrams` when this fails after a table change."""
        assert (ROOT / "diagrams" / "lifecycle.mmd").read_text() == diagram.mermaid()
        assert (ROOT / "diagrams" / "lifecycle.dot").read_text() == diagram.dot()
        assert (ROOT / "diagrams" / "transitions.md").read_text() == diagram.reference_markdown()
        assert (ROOT / "diagrams" / "groups.mmd").read_text() == diagram.groups_mermaid()

    def test_readme_embeds_the_current_diagram(self):
        readme = (ROOT / "README.md").read_text()
        assert "<!-- BEGIN GENERATED: diagram -->\n" + diagram.readme_block() + "<!-- END" in readme

    def test_every_edge_is_drawn(self):
        text = diagram.mermaid()
        for row in TABLE:
            for edge in row_edges(row):
                assert f"{edge.source.value} --> {edge.dest.value}: {row.operation}" in text
        for state in (State.AWAKE, State.PAUSED, State.SAVING, State.SYNCING):
            assert f"{state.value} --> FAILED: hook raised" in text

    def test_every_way_of_sleeping_is_drawn_with_its_reload(self):
        text = diagram.groups_mermaid()
        for way, asleep in ASLEEP.items():
            assert f"alive --> {asleep.value}: process_groups.destroy [communicators={way.value}]" in text
            assert f"{asleep.value} --> alive: process_groups.reload" in text
        assert text.split("\n", 1)[1] in diagram.readme_block()
        assert (
            "- `communicators=suspend`: suspended after `process_groups.destroy`"
            in diagram.reference_markdown()
        )

    def test_reference_has_a_line_per_row(self):
        lines = [line for line in diagram.reference_markdown().splitlines() if line.startswith("| `")]
        assert len(lines) == len(TABLE)
