"""The run-time type checker the test suite installs over jaxkv (conftest).

beartype with its default strategy: every argument's type, jaxtyping's array
shapes and dtypes included, and one item of each container.
"""

from beartype import beartype

typecheck = beartype
