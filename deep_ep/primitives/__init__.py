"""DeepEP V2's experimental primitives beside dispatch/combine, one room each: pipeline-parallel
send/recv (`pp`), all-gather / reduce-scatter sessions (`agrs`), Engram remote-memory fetch
(`engram`). Each module holds the public methods (a mixin of `deep_ep.ElasticBuffer`) and their
checks (`engram` also its reference fetch); backends implement the moves, the CPU backend's serving
as the executable specification. `window_use` keeps two
users of the buffer's window from overlapping."""
from .agrs import AllGatherReduceScatterMixin
from .engram import EngramMixin
from .pp import PipelineMixin
from .window_use import WindowUse

__all__ = ["AllGatherReduceScatterMixin", "EngramMixin", "PipelineMixin", "WindowUse"]
