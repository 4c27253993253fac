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


def test_a_spec_names_a_compiled_kernel_instead_of_an_operator():
    spec = fault_spec.FaultSpec.parse(
        "kind=bitflip,kernel=cpp_fused_add_mul_3,output=1,step=2,nth=0,index=7,bit=30"
    )
    assert (spec.kernel, spec.output, spec.op) == ("cpp_fused_add_mul_3", 1, None)
    assert spec.matches_kernel("cpp_fused_add_mul_3", "<root>", "forward")
    assert not spec.matches_kernel("cpp_fused_add_mul_4", "<root>", "forward")
    assert not spec.matches_key("aten.add.Tensor", "<root>", "forward")  # never an operator
    assert (
        str(spec) == "kind=bitflip,kernel=cpp_fused_add_mul_3,output=1,step=2,nth=0,index=7,bit=30"
    )


def test_kernel_and_op_exclude_each_other_and_output_needs_a_kernel():
    import pytest

    from sdcreplay.errors import FaultSpecError

    for text, problem in [
        ("kind=bitflip,kernel=cpp_fused_add_0,op=aten.add", "not both"),
        ("kind=bitflip,step=1", "needs op= .* or kernel="),
        ("kind=bitflip,op=aten.mm,output=1", "output= picks one of the tensors a kernel="),
        ("kind=memflip,param=w,step=0,kernel=cpp_fused_add_0", "not a kernel's output"),
    ]:
        with pytest.raises(FaultSpecError, match=problem):
            fault_spec.FaultSpec.parse(text)
