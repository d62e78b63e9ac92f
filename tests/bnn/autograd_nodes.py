"""The names of every node in an autograd graph: which route a value took (shared by the tests
here, and imported by the interpreted check's subprocess)."""


def node_names(value) -> str:
    """The class names of every node reachable from ``value.grad_fn``, space-separated, with each
    node's ``name()`` (a C++ node's class is ``CppFunction``; its name says which it is) and, for a
    ``cfbnn::`` operator's autograd node (``OperatorAutogradBackward``), the operator's name."""
    seen, stack = set(), [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions)
    names = []
    for node in seen:
        operator = getattr(node, "operator", None)
        names.append(f"{type(node).__name__} {node.name()}" + (f" cfbnn::{operator.name}" if operator else ""))
    return " ".join(names)
