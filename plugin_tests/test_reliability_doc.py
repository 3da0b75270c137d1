"""docs/reliability.md shows what benchmarks/results/reliability.json holds
(the reliability tests write the file and re-render the page)."""

from __future__ import annotations

from integration import reliability_doc


def test_page_is_in_sync_with_the_results():
    assert reliability_doc.DOC.read_text() == reliability_doc.rendered_page(), (
        "run: python -m integration.reliability_doc")


def test_render_counts_lost_requests():
    row = {"seconds": 40, "clients": 32, "requests": 10, "kv_tokens": 1024, "preemptions": 3,
           "completed_identical": 8, "http_errors": 0, "lost": 1, "wrong_output": 1,
           "rss_growth_pct": {"EngineCore": 0.1}, "health_failures": 0, "recorded": "t"}
    text = reliability_doc.render({"load": {"short": row}})
    assert "Requests lost or wrong under load and SIGTERM: 2**" in text
    assert "| short | 40 | 32 | 10 | 1024 | 3 | 8 | 0 | 1 | 1 | EngineCore +0.10% | 0 | t |" in text
