"""What flexattn's torch.compile path reads that Dynamo before PyTorch 2.14 cannot trace, answered
from Dynamo's own record of the values. _api installs it on those releases only.

- A function defined inside the compiled code (Dynamo's NestedUserFunctionVariable) has no
  __closure__ or __module__ there: Dynamo raises Unsupported on reading them. A call of
  _api._function_parts on such a function returns the code, the module name and the closure
  cells' contents that Dynamo keeps for it.
- assume_constant_result takes only tensors and Python constants as arguments before 2.12, so an
  object a modifier closes over (the module `self` of a forward) cannot reach the trace. A call of
  _api._constant_trace passes such an object as itself, guarded on its identity, as 2.12 does.

Both answer calls of those two functions alone; everything else Dynamo traces as it would.
"""

from __future__ import annotations

import re


def needed(version: str) -> bool:
    """Whether torch `version` (torch.__version__) is a release before 2.14."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) < (2, 14)


def install(function_parts, constant_trace) -> None:
    """Answers Dynamo's calls of `function_parts` and `constant_trace` (see above); nothing where
    this Dynamo lacks the parts it uses."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import ConstantSource
        from torch._dynamo.variables import (ConstantVariable, TensorVariable, TupleVariable,
                                             UserDefinedObjectVariable)
        from torch._dynamo.variables.functions import (NestedUserFunctionVariable,
                                                       UserFunctionVariable)
    except ImportError:
        return
    traced_call = UserFunctionVariable.call_function

    def convert(variable):
        if isinstance(variable, TensorVariable):
            return variable.get_real_value()
        if isinstance(variable, UserDefinedObjectVariable):
            if variable.source is not None:
                install_guard(variable.make_guard(GuardBuilder.ID_MATCH))
            return variable.value
        return variable.as_python_constant()

    def call_function(self, tx, args, kwargs):
        if (self.fn is function_parts and len(args) == 1 and not kwargs
                and isinstance(args[0], NestedUserFunctionVariable)):
            function = args[0]
            cells = function.closure.items if function.closure is not None else ()
            return TupleVariable([
                function.code, ConstantVariable.create(function.f_globals.get("__name__")),
                TupleVariable([tx.output.side_effects.load_cell(cell) for cell in cells])])
        if self.fn is constant_trace and not kwargs:
            name = self.get_name()
            result = constant_trace(*(convert(arg) for arg in args))
            return tx.output.register_attr_or_module(result, name, source=ConstantSource(name))
        return traced_call(self, tx, args, kwargs)

    UserFunctionVariable.call_function = call_function
