"""The contract between :class:`~dpu_pipe.Loader` and its engines (as torch's
``_BaseDataLoaderIter`` and its ``_next_data``)."""

__all__ = ["Engine", "Cancelled"]


class Engine:
    """What makes a loader's batches. Subclasses implement:

    - ``start(epoch, step, end)``: the next batches are steps ``step .. end - 1`` of
      ``epoch`` (work in flight that continues from there may be kept);
    - ``_next_data(epoch, step)``: that batch as ``(images, labels, indices)`` arrays
      (``indices``: each row's dataset index), waiting at most the loader's ``timeout``,
      valid until ``release_held``, the one path by which the held buffer returns;
    - ``pause``: the iteration ended (work ahead may be kept); ``close``: stop all work and
      give back every buffer;
    - :attr:`makers`: the host's :class:`~dpu_pipe.batch.BatchMaker` s (the loader adds
      up their stats and bad samples); :meth:`stats`, :meth:`busy` and :attr:`remote_bad`:
      what the engine knows beyond them.
    """

    makers = ()
    remote_bad = {}
    #: A ``threading.Event`` set when another thread ends the iteration: raise :class:`Cancelled`.
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
    """Another thread ended the iteration an engine waited in (the loader raises
    :class:`ConfigError` saying who)."""
