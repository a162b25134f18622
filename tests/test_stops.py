from tinyloop.stops import StopMatcher


def test_stop_across_pieces_emits_nothing_of_it():
    m = StopMatcher(["END HERE"])
    out = [m.feed(p) for p in ["abc E", "ND ", "HER", "E tail"]]
    assert "".join(out) == "abc "
    assert m.stopped and m.matched == "END HERE"
    assert m.flush() == ""


def test_hold_back_released_when_it_cannot_match():
    m = StopMatcher(["###"])
    assert m.feed("a#") == "a"
    assert m.feed("#b") == "##b"
    assert not m.stopped
    assert m.feed("x#") == "x"
    assert m.flush() == "#"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"
    assert m.matched == "lo w"


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""
