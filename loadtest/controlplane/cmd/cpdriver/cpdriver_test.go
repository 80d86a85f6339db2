package main

import "testing"

func TestContentTypeFromAccept(t *testing.T) {
	for accept, want := range map[string]string{
		"application/vnd.kubernetes.protobuf,application/json": "application/vnd.kubernetes.protobuf",
		"application/vnd.kubernetes.protobuf, */*":             "application/vnd.kubernetes.protobuf",
		"application/json;as=Table;v=v1;g=meta.k8s.io":         "application/json",
		"*/*": "application/json",
	} {
		if got := contentTypeFromAccept(accept); got != want {
			t.Errorf("contentTypeFromAccept(%q) = %q, want %q", accept, got, want)
		}
	}
}

func TestCompare(t *testing.T) {
	via := map[string]state{"a/1": {"5", "h"}, "a/2": {"6", "h"}, "a/3": {"7", "x"}, "a/4": {"8", "h"}}
	direct := map[string]state{"a/1": {"5", "h"}, "a/2": {"9", "h"}, "a/3": {"7", "y"}, "a/5": {"10", "h"}}
	got := compare(via, direct)
	want := []string{"a/2 resourceVersion differs", "a/3 data differs", "a/4 missing in direct", "a/5 missing in via"}
	if len(got) != len(want) {
		t.Fatalf("compare = %v, want %v", got, want)
	}
	for i, d := range got {
		if d.Key+" "+d.Reason != want[i] {
			t.Errorf("diff[%d] = %s %s, want %s", i, d.Key, d.Reason, want[i])
		}
	}
	if d := compare(via, via); len(d) != 0 {
		t.Errorf("compare(x, x) = %v, want none", d)
	}
}

func TestBehind(t *testing.T) {
	expected := map[string]string{"n/kept": "12", "n/gone": ""}
	if d := behind(map[string]state{"n/kept": {"12", "h"}}, expected); len(d) != 0 {
		t.Errorf("up-to-date store reported behind: %v", d)
	}
	if d := behind(map[string]state{"n/kept": {"11", "h"}}, expected); len(d) != 1 || d[0].Key != "n/kept" {
		t.Errorf("stale object: %v", d)
	}
	if d := behind(map[string]state{"n/kept": {"12", "h"}, "n/gone": {"3", "h"}}, expected); len(d) != 1 || d[0].Key != "n/gone" {
		t.Errorf("deleted object still present: %v", d)
	}
	if d := behind(map[string]state{}, expected); len(d) != 1 || d[0].Key != "n/kept" {
		t.Errorf("missing object: %v", d)
	}
}

func TestFirstDifference(t *testing.T) {
	a := []string{"ADDED n/a 5", "MODIFIED n/a 6"}
	if i, _, _ := firstDifference(a, a); i != -1 {
		t.Errorf("equal sequences differ at %d", i)
	}
	i, via, direct := firstDifference(a[:1], a)
	if i != 1 || via != "" || direct != "MODIFIED n/a 6" {
		t.Errorf("a missing event: %d %q %q", i, via, direct)
	}
	repeated := []string{"ADDED n/a 5", "MODIFIED n/a 5", "MODIFIED n/a 6"}
	if i, via, _ := firstDifference(repeated, a); i != 1 || via != "MODIFIED n/a 5" {
		t.Errorf("a repeated event: %d %q", i, via)
	}
}
