"""Prometheus text exposition of the operator's metrics."""

from dscache_operator.metrics import Metrics


def test_render():
    m = Metrics()
    assert m.render() == "\n"
    m.inc("dscache_wipes_total", "Wipes.", result="succeeded")
    m.inc("dscache_wipes_total", "Wipes.", result="succeeded")
    m.set_cache("ml", "a", "Ready", ["Ready", "Wiped"])
    m.set_cache("ml", "b", "Failed", [])
    m.observe_admission(0.003)
    text = m.render()
    assert 'dscache_wipes_total{result="succeeded"} 2' in text
    assert "# TYPE dscache_wipes_total counter" in text
    assert 'dscache_datasetcaches{phase="Ready"} 1' in text and 'dscache_datasetcaches{phase="Failed"} 1' in text
    assert 'dscache_node_copies{state="Wiped"} 1' in text
    assert 'dscache_admission_seconds_bucket{le="0.0025"} 0' in text
    assert 'dscache_admission_seconds_bucket{le="0.005"} 1' in text
    assert "dscache_admission_seconds_count 1" in text
    m.forget_cache("ml", "b")
    assert 'phase="Failed"' not in m.render()
