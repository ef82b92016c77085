"""The contract between :class:`~dpu_pipe.Loader` and the engines that make its batches (the
split of torch's ``_BaseDataLoaderIter`` and its ``_next_data``)."""

__all__ = ["Engine", "Cancelled"]


class Engine:
    """What makes a loader's batches. The contract, which subclasses implement:

    - ``start`` ``(epoch, step, end)``: the loader's next batches are steps ``step`` ..
      ``end - 1`` of ``epoch`` (work in flight that continues from there may be kept);
    - ``_next_data`` ``(epoch, step)``: that batch as ``(images, labels, indices)``
      arrays (``indices``: the dataset index of each row), waiting at most the loader's
      ``timeout``. The arrays stay valid until ``release_held``;
    - ``release_held``: give back the buffer of the batch the caller holds (the one
      path by which a held buffer returns);
    - ``pause``: the iteration ended or was superseded (work ahead may be kept);
    - ``close``: stop all work and give back every buffer;
    - :attr:`makers`: the :class:`~dpu_pipe.batch.BatchMaker` s making batches on this
      host (the loader adds up their stats and bad samples); :meth:`stats`, :meth:`busy`
      and :attr:`remote_bad`: what the engine knows beyond them.
    """

    makers = ()
    remote_bad = {}
    #: Set (a ``threading.Event``) by the loader when another thread ends the iteration
    #: ``_next_data`` is waiting for: the wait then raises :class:`Cancelled`.
    cancel = None

    def stats(self, made):
        """The loader's counters given ``made``, the :class:`~dpu_pipe.batch.MakerStats`
        summed over :attr:`makers`."""
        return made.as_dict()

    def busy(self, stats):
        """``(seconds, makers)`` the batch makers spent reading and decoding, given the
        loader's ``stats``; None when the makers are :attr:`makers`."""
        return None


class Cancelled(Exception):
    """An engine's wait for a batch ended because another thread ended its iteration (the
    loader turns it into a :class:`ConfigError` saying who)."""
