"""An optimal Sokoban solver: breadth-first search over (player position, box positions) states.

It reads the text grid the environment shows the policy (:func:`megatron_gigpo.envs.sokoban.render_grid`:
``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on a target, ``P`` player, ``S`` player on a
target) and moves by gym-sokoban's rules: a move enters a free cell (floor or target); moving into a box pushes
it when the cell behind it is free; anything else leaves the state unchanged. Every move costs one step, so a
breadth-first search from the current state finds a shortest move sequence that puts every box on a target.
Moves are tried in the order up, down, left, right, so the plan returned is deterministic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

Cell = tuple[int, int]

#: Moves in gym-sokoban's order and their (row, column) offsets.
MOVES: dict[str, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_WALL, _FLOOR, _TARGET, _BOX, _BOX_ON_TARGET, _PLAYER, _PLAYER_ON_TARGET = "#", "_", "O", "X", "\u221a", "P", "S"
_SYMBOLS = {_WALL, _FLOOR, _TARGET, _BOX, _BOX_ON_TARGET, _PLAYER, _PLAYER_ON_TARGET}
#: States a search may visit before it gives up (a 6x6 room with one box has a few hundred).
DEFAULT_MAX_STATES = 2_000_000


class UnsolvableError(RuntimeError):
    """No move sequence from this state puts every box on a target (a deadlock), or the search hit its limit."""


@dataclass(frozen=True)
class SokobanRoom:
    """The fixed part of a room: walls and targets. Cells outside ``shape`` count as walls."""

    shape: tuple[int, int]
    walls: frozenset[Cell]
    targets: frozenset[Cell]

    def free(self, cell: Cell) -> bool:
        """The cell is inside the room and not a wall (boxes are checked by the caller)."""
        r, c = cell
        return 0 <= r < self.shape[0] and 0 <= c < self.shape[1] and cell not in self.walls


@dataclass(frozen=True)
class SokobanState:
    """The moving part: the player's cell and the set of box cells."""

    player: Cell
    boxes: frozenset[Cell]


def parse_grid(text: str) -> tuple[SokobanRoom, SokobanState]:
    """Room and state of a text grid (rows on lines, cells separated by spaces).

    Raises:
        ValueError: ragged rows, an unknown symbol, not exactly one player, or boxes and targets in different
            numbers.
    """
    rows = [line.split() for line in text.strip().splitlines()]
    if not rows or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(f"Sokoban grid rows differ in length or the grid is empty: {text!r}")
    walls, targets, boxes, players = set(), set(), set(), []
    for r, row in enumerate(rows):
        for c, symbol in enumerate(row):
            if symbol not in _SYMBOLS:
                raise ValueError(f"Sokoban grid: unknown symbol {symbol!r} at row {r}, column {c}")
            cell = (r, c)
            if symbol == _WALL:
                walls.add(cell)
            if symbol in (_TARGET, _BOX_ON_TARGET, _PLAYER_ON_TARGET):
                targets.add(cell)
            if symbol in (_BOX, _BOX_ON_TARGET):
                boxes.add(cell)
            if symbol in (_PLAYER, _PLAYER_ON_TARGET):
                players.append(cell)
    if len(players) != 1:
        raise ValueError(f"Sokoban grid: expected one player (P or S), found {len(players)}")
    if len(boxes) != len(targets):
        raise ValueError(f"Sokoban grid: {len(boxes)} boxes but {len(targets)} targets")
    room = SokobanRoom((len(rows), len(rows[0])), frozenset(walls), frozenset(targets))
    return room, SokobanState(players[0], frozenset(boxes))


def apply_move(room: SokobanRoom, state: SokobanState, move: str) -> SokobanState:
    """The state after ``move`` (one of :data:`MOVES`); the same state when the move is blocked."""
    dr, dc = MOVES[move]
    ahead = (state.player[0] + dr, state.player[1] + dc)
    if not room.free(ahead):
        return state
    if ahead not in state.boxes:
        return SokobanState(ahead, state.boxes)
    beyond = (ahead[0] + dr, ahead[1] + dc)
    if not room.free(beyond) or beyond in state.boxes:
        return state
    return SokobanState(ahead, (state.boxes - {ahead}) | {beyond})


def is_solved(room: SokobanRoom, state: SokobanState) -> bool:
    return state.boxes == room.targets


def solve(room: SokobanRoom, state: SokobanState, max_states: int = DEFAULT_MAX_STATES) -> list[str]:
    """A shortest move sequence from ``state`` to a solved room; ``[]`` when it is solved already.

    Raises:
        UnsolvableError: no sequence exists (every reachable state was searched), or more than ``max_states``
            states were visited (the message says which).
    """
    if is_solved(room, state):
        return []
    parent: dict[SokobanState, tuple[SokobanState, str] | None] = {state: None}
    frontier = deque([state])
    while frontier:
        current = frontier.popleft()
        for move in MOVES:
            nxt = apply_move(room, current, move)
            if nxt in parent:
                continue
            parent[nxt] = (current, move)
            if is_solved(room, nxt):
                return _path(parent, nxt)
            if len(parent) > max_states:
                raise UnsolvableError(f"Sokoban search gave up after {max_states} states (raise max_states)")
            frontier.append(nxt)
    raise UnsolvableError(f"no move sequence solves this room ({len(parent)} reachable states searched)")


def _path(parent: dict[SokobanState, tuple[SokobanState, str] | None], end: SokobanState) -> list[str]:
    moves = []
    link = parent[end]
    while link is not None:
        previous, move = link
        moves.append(move)
        link = parent[previous]
    return moves[::-1]


def solve_grid(text: str, max_states: int = DEFAULT_MAX_STATES) -> list[str]:
    """:func:`solve` on a text grid (raises as :func:`parse_grid` and :func:`solve`)."""
    room, state = parse_grid(text)
    return solve(room, state, max_states)


def optimal_moves(text: str, max_states: int = DEFAULT_MAX_STATES) -> frozenset[str]:
    """The moves of :data:`MOVES` after which the shortest solution of the text grid is one move shorter:
    every first move of some shortest plan. Empty when the room is solved already or cannot be solved
    (also from the start). A blocked move (into a wall, or pushing a box into one) is never optimal.

    Raises:
        ValueError: as :func:`parse_grid`.
    """
    room, state = parse_grid(text)
    try:
        remaining = len(solve(room, state, max_states))
    except UnsolvableError:
        return frozenset()
    best = set()
    for move in MOVES if remaining else ():
        nxt = apply_move(room, state, move)
        if nxt == state:  # blocked: the plan cannot get shorter
            continue
        try:
            if len(solve(room, nxt, max_states)) == remaining - 1:
                best.add(move)
        except UnsolvableError:
            pass
    return frozenset(best)
