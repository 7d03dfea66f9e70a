"""The pytest plugin: loaded by the pytest11 entry point, it imports nothing heavy until used."""

import textwrap
from helpers import pytest_in

# A project that does not use saferun: the plugin must be loaded (its option exists) but have
# imported neither torch nor any of saferun's training code.
NOT_USING_SAFERUN = textwrap.dedent("""
    import sys

    def test_nothing_heavy_is_imported(request):
        assert request.config.pluginmanager.hasplugin("saferun")
        assert request.config.getoption("saferun_update_golden") is False
        light = {"saferun", "saferun.version", "saferun.pytest_plugin", "saferun.testing",
                 "saferun.testing.options"}
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy")
                       or (m.split(".")[0] == "saferun" and m not in light))
        assert heavy == [], heavy
""")

def test_the_plugin_imports_nothing_heavy_in_a_project_that_does_not_use_it(tmp_path):
    (tmp_path / "test_plain.py").write_text(NOT_USING_SAFERUN)
    proc = pytest_in(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_option_and_fixtures_in_this_session(request, saferun_update_golden, saferun_testing):
    # this suite runs under the installed plugin too
    assert request.config.pluginmanager.hasplugin("saferun")
    assert saferun_update_golden is request.config.getoption("saferun_update_golden")
    assert saferun_testing.assert_golden_losses.__module__ == "saferun.testing.golden"
