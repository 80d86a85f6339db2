package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// resumeResult is what informer-resume prints.
type resumeResult struct {
	// Equal: the informer through the path under test was told exactly the events,
	// in order, that the one straight at the apiserver was told.
	Equal bool `json:"equal"`
	// Events is how many events the direct informer was told.
	Events int `json:"events"`
	// ViaEvents is how many the informer under test was told.
	ViaEvents int `json:"via_events"`
	// FirstDifference is the first position where the two sequences differ, with
	// both events there ("" past a sequence's end); -1 when equal.
	FirstDifference int    `json:"first_difference"`
	ViaEvent        string `json:"via_event"`
	DirectEvent     string `json:"direct_event"`
	// ViaLists counts the LIST requests the informer under test sent: 1 is its
	// first sync, more are relists.
	ViaLists int64 `json:"via_lists"`
	// ViaWatches counts its WATCH requests (each resumption is one).
	ViaWatches int64 `json:"via_watches"`
	// Churned is the number of writes made.
	Churned int `json:"churned"`
	// ViaRequests is the informer under test's LIST and WATCH requests in order,
	// each with how it ended ("LIST rv=0: 200", "WATCH rv=1234: 200, body: EOF").
	ViaRequests []string `json:"via_requests"`
}

// recorder keeps the events an informer's handler is told, as
// "TYPE namespace/name resourceVersion" lines in order.
type recorder struct {
	mu     sync.Mutex
	events []string
}

func (r *recorder) add(kind string, obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		// A delete the informer inferred from a relist, not one it was told.
		kind, obj = "DELETED-UNSEEN", tomb.Obj
	}
	meta, err := metaOf(obj)
	if err != nil {
		return
	}
	line := fmt.Sprintf("%s %s/%s %s", kind, meta.GetNamespace(), meta.GetName(), meta.GetResourceVersion())
	r.mu.Lock()
	r.events = append(r.events, line)
	r.mu.Unlock()
}

func (r *recorder) snapshot() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.events...)
}

func metaOf(obj any) (metav1.Object, error) {
	if m, ok := obj.(metav1.Object); ok {
		return m, nil
	}
	return nil, fmt.Errorf("not an object: %T", obj)
}

// handlers records every notification: an update whose object did not change
// (what a relist tells about every object) is recorded like any other, so it
// shows as a repeated event.
func (r *recorder) handlers() cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { r.add("ADDED", obj) },
		UpdateFunc: func(_, obj any) { r.add("MODIFIED", obj) },
		DeleteFunc: func(obj any) { r.add("DELETED", obj) },
	}
}

// requestCounter counts the LIST and WATCH requests a client sends, and keeps
// how each ended: a relist's cause is the request before it.
type requestCounter struct {
	next    http.RoundTripper
	lists   atomic.Int64
	watches atomic.Int64
	mu      sync.Mutex
	log     []string
}

func (c *requestCounter) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method != http.MethodGet {
		return c.next.RoundTrip(req)
	}
	verb := "LIST"
	switch req.URL.Query().Get("watch") {
	case "1", "true":
		verb = "WATCH"
		c.watches.Add(1)
	default:
		c.lists.Add(1)
	}
	at := c.record(fmt.Sprintf("%s rv=%s", verb, req.URL.Query().Get("resourceVersion")))
	resp, err := c.next.RoundTrip(req)
	if err != nil {
		c.amend(at, fmt.Sprintf(": %v", err))
		return resp, err
	}
	c.amend(at, fmt.Sprintf(": %d", resp.StatusCode))
	if verb == "WATCH" {
		resp.Body = &endRecorder{ReadCloser: resp.Body, end: func(err error) {
			c.amend(at, fmt.Sprintf(", body: %v", err))
		}}
	}
	return resp, nil
}

func (c *requestCounter) record(line string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.log = append(c.log, line)
	return len(c.log) - 1
}

func (c *requestCounter) amend(at int, more string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.log[at] += more
}

func (c *requestCounter) requests() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.log...)
}

// endRecorder tells end the first error its body's reads return (io.EOF for a
// clean end), once.
type endRecorder struct {
	io.ReadCloser
	once sync.Once
	end  func(error)
}

func (r *endRecorder) Read(p []byte) (int, error) {
	n, err := r.ReadCloser.Read(p)
	if err != nil {
		r.once.Do(func() { r.end(err) })
	}
	return n, err
}

// informerResume runs one informer through --via and one straight at
// --direct on a fresh namespace, writes through --direct every --interval,
// and writes --ready-file once both are synced. Meanwhile the caller restarts
// what --via points at; once it writes --done-file the driver makes --after
// more writes and waits until both informers were told the same events.
func informerResume(args []string) (any, error) {
	fs := newFlagSet("informer-resume")
	via := fs.String("via", "", "kubeconfig of the path under test (e.g. through Bulwark)")
	direct := fs.String("direct", "", "kubeconfig straight to the kube-apiserver (the reference; writes go here)")
	resource := fs.String("resource", "secrets", "secrets or endpointslices")
	accept := fs.String("accept", "", "rest.Config.AcceptContentTypes for the via client")
	readyFile := fs.String("ready-file", "", "written once both informers are synced")
	doneFile := fs.String("done-file", "", "the caller writes it when the disturbance is over")
	interval := fs.Duration("interval", 100*time.Millisecond, "time between writes")
	after := fs.Int("after", 10, "writes made after --done-file appears")
	timeout := fs.Duration("timeout", 120*time.Second, "overall time limit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *via == "" || *direct == "" || *readyFile == "" || *doneFile == "" {
		return nil, errors.New("--via, --direct, --ready-file and --done-file are required")
	}
	if *resource != "secrets" && *resource != "endpointslices" {
		return nil, fmt.Errorf("--resource must be secrets or endpointslices, not %q", *resource)
	}
	// LIST then WATCH, so that a relist is a LIST the counter sees.
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", "false"); err != nil {
		return nil, err
	}
	counter := &requestCounter{}
	viaClient, err := clientWrapped(*via, *accept, func(rt http.RoundTripper) http.RoundTripper {
		counter.next = rt
		return counter
	})
	if err != nil {
		return nil, err
	}
	directClient, err := clientFor(*direct, "", "")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	// A fresh namespace: both informers start empty, so every event they are
	// told is one of the writes below.
	ns, _, err := churnNamespace(ctx, directClient, "")
	if err != nil {
		return nil, err
	}
	expected := map[string]string{}
	defer func() {
		cleanupChurn(directClient, *resource, expected)
		_ = directClient.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	}()
	var viaEvents, directEvents recorder
	if err := runRecorded(ctx, viaClient, *resource, ns, &viaEvents); err != nil {
		return nil, fmt.Errorf("via informer: %w", err)
	}
	if err := runRecorded(ctx, directClient, *resource, ns, &directEvents); err != nil {
		return nil, fmt.Errorf("direct informer: %w", err)
	}
	if err := os.WriteFile(*readyFile, []byte(ns+"\n"), 0o644); err != nil {
		return nil, err
	}

	written, left := 0, -1
	tick := time.NewTicker(*interval)
	defer tick.Stop()
	for left != 0 {
		if err := churnOne(ctx, directClient, *resource, ns, written, expected); err != nil {
			return nil, fmt.Errorf("write %d: %w", written, err)
		}
		written++
		if left > 0 {
			left--
		} else if _, err := os.Stat(*doneFile); err == nil {
			left = *after
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("still writing at the timeout (%d writes): is --done-file written?", written)
		case <-tick.C:
		}
	}

	// Wait until the direct informer shows the last write and the via one
	// was told the same events.
	res := resumeResult{Churned: written}
	for {
		v, d := viaEvents.snapshot(), directEvents.snapshot()
		res.Events, res.ViaEvents = len(d), len(v)
		res.FirstDifference, res.ViaEvent, res.DirectEvent = firstDifference(v, d)
		res.ViaLists, res.ViaWatches = counter.lists.Load(), counter.watches.Load()
		res.ViaRequests = counter.requests()
		res.Equal = res.FirstDifference < 0
		if res.Equal && len(d) == written {
			return res, nil
		}
		select {
		case <-ctx.Done():
			res.Equal = false
			return res, nil
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// churnOne makes write i of doChurn's pattern in namespace ns.
func churnOne(ctx context.Context, client kubernetes.Interface, resource, ns string, i int, expected map[string]string) error {
	k, phase := i/3, i%3
	name := fmt.Sprintf("churn-%d", k)
	del := phase == 2 && k%2 == 0
	var rv string
	var err error
	switch resource {
	case "secrets":
		rv, err = churnSecret(ctx, client, ns, name, i, phase == 0, del)
	case "endpointslices":
		rv, err = churnSlice(ctx, client, ns, name, i, phase == 0, del)
	}
	if err != nil {
		return err
	}
	expected[ns+"/"+name] = rv
	return nil
}

// runRecorded starts an informer on resource in namespace ns whose handler
// records into rec, and waits for its initial sync. It stops when ctx ends.
func runRecorded(ctx context.Context, client kubernetes.Interface, resource, ns string, rec *recorder) error {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ns))
	var informer cache.SharedIndexInformer
	switch resource {
	case "secrets":
		informer = factory.Core().V1().Secrets().Informer()
	case "endpointslices":
		informer = factory.Discovery().V1().EndpointSlices().Informer()
	}
	if _, err := informer.AddEventHandler(rec.handlers()); err != nil {
		return err
	}
	factory.StartWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return fmt.Errorf("no initial sync of %s before the timeout", resource)
	}
	return nil
}

// firstDifference is the first index where a and b differ, with the events
// there; -1 when they are equal.
func firstDifference(a, b []string) (int, string, string) {
	at := func(s []string, i int) string {
		if i < len(s) {
			return s[i]
		}
		return ""
	}
	for i := 0; i < len(a) || i < len(b); i++ {
		if at(a, i) != at(b, i) {
			return i, at(a, i), at(b, i)
		}
	}
	return -1, "", ""
}
