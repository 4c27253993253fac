"""The fault spec's grammar is checked without torch: every command refuses a typo before it
loads torch (docs/fault-injection.md has the grammar; test_faults.py tests what it injects)."""

from __future__ import annotations

import subprocess
import sys

from sdcreplay.capture import fault_spec, faults


def test_parsing_a_spec_imports_no_torch():
    code = (
        "import sys; from sdcreplay.capture.fault_spec import parse_specs; "
        "spec, = parse_specs(['kind=mask,op=aten.mm,mask=0x0f,step=2,device=cpu:1'], False); "
        "print(spec, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["kind=mask,op=aten.mm,step=2,mask=0xf,device=cpu:1", "False"]


def test_faults_names_the_same_grammar():
    assert faults.FaultSpec is fault_spec.FaultSpec
    assert faults.parse_specs is fault_spec.parse_specs
    assert faults.ENV_VAR == fault_spec.ENV_VAR == "SDCREPLAY_INJECT"
