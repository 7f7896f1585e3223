package main

import (
	"fmt"
	"strings"
)

// direction is what an operation does to the target's memory: READ it into
// the initiator's buffer, or WRITE the initiator's buffer into it.
type direction uint8

const (
	dirRead direction = iota + 1
	dirWrite
)

// String is the direction as results, the table and the protocol spell it.
func (d direction) String() string {
	switch d {
	case dirRead:
		return "READ"
	case dirWrite:
		return "WRITE"
	}
	return fmt.Sprintf("direction(%d)", uint8(d))
}

// parseDirection reads a direction as -ops spells it (read, write) or as
// String does, in any case.
func parseDirection(s string) (direction, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "read":
		return dirRead, nil
	case "write":
		return dirWrite, nil
	}
	return 0, fmt.Errorf("unknown operation %q: want read, write", s)
}

// MarshalText keeps the protocol's "op" a string, READ or WRITE, so targets
// and initiators of other builds still understand each other.
func (d direction) MarshalText() ([]byte, error) {
	if d != dirRead && d != dirWrite {
		return nil, fmt.Errorf("no such direction: %d", uint8(d))
	}
	return []byte(d.String()), nil
}

func (d *direction) UnmarshalText(b []byte) error {
	v, err := parseDirection(string(b))
	if err != nil {
		return err
	}
	*d = v
	return nil
}
